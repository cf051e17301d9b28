package builds

import (
	"context"
	"fmt"
	"strings"

	"github.com/jackc/pgx/v5"
)

// Reset empties the projection so that a replay can build it again from
// the stream (projection.Resetter). TRUNCATE takes an exclusive lock, so
// readers wait for the replay's first commit rather than see half a table.
func (p *Projector) Reset(ctx context.Context, tx pgx.Tx) error {
	p.cache.forget()
	tables := append(append([]string{}, DigestTables...), "build_output_chunks")
	if _, err := tx.Exec(ctx, "truncate "+strings.Join(tables, ", ")); err != nil {
		return fmt.Errorf("builds: reset: %w", err)
	}
	return nil
}

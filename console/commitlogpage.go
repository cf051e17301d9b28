package console

import (
	"context"
	"net/http"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
)

// CommitLog is what the commit-log page reads, from the bucket the
// compactor folds into and from the backbone: the process implements it
// (cmd/millrace), so that the console needs neither.
type CommitLog interface {
	// Worlds are the worlds the compactor has folded, with their lag.
	Worlds(ctx context.Context) ([]World, error)
	// Consumers are the durable consumers that follow streams on their
	// own (the compactor, the Kafka export), with their lag.
	Consumers(ctx context.Context) ([]ConsumerLag, error)
}

// World is one world of the commit log: its latest checkpoint, and what
// the stream holds after it (the compaction lag).
type World struct {
	World string `json:"world"`
	// Documents are the live documents at the checkpoint; Versions the
	// versions it folded, and Pending those the stream holds after it.
	Documents    int        `json:"documents"`
	Versions     uint64     `json:"versions"`
	Checkpoint   uint64     `json:"checkpoint_seq"`
	CheckpointAt *time.Time `json:"checkpoint_at"`
	Pending      uint64     `json:"pending"`
	// OldestPending is when the oldest pending version was stored: how
	// far behind the folded state is.
	OldestPending *time.Time `json:"oldest_pending_at"`
}

// ConsumerLag is a durable consumer's position on its stream and what it
// has still to take.
type ConsumerLag struct {
	Kind     string `json:"kind"` // compactor, export
	Stream   string `json:"stream"`
	Consumer string `json:"consumer"`
	// Position is its ack floor (the stream sequence up to which it has
	// taken everything); Pending what it has not been given yet,
	// AckPending what it was given and has not acknowledged.
	Position   uint64 `json:"position"`
	Pending    uint64 `json:"pending"`
	AckPending uint64 `json:"ack_pending"`
	// LastSeq is the stream's last sequence.
	LastSeq uint64 `json:"last_seq"`
}

// commitLogView is the commit-log page.
type commitLogView struct {
	frame
	Worlds    []World       `json:"worlds"`
	Consumers []ConsumerLag `json:"consumers"`
	Now       time.Time     `json:"-"`
	Error     string        `json:"error,omitempty"`
}

// commitLogPage serves /commits and /api/v1/commits.
func commitLogPage(cl CommitLog) handler {
	return func(w http.ResponseWriter, r *http.Request, _ *pgxpool.Pool) {
		if cl == nil {
			msg := "this process serves no commit log"
			if isAPI(r) {
				writeJSON(w, http.StatusNotImplemented, map[string]string{"error": msg})
				return
			}
			render(w, http.StatusNotImplemented, "error", errorPage{Title: "Commit log", Error: msg})
			return
		}
		ctx, cancel := context.WithTimeout(r.Context(), 20*time.Second)
		defer cancel()
		v := commitLogView{Now: time.Now().UTC()}
		v.JSON = "/api/v1/commits"
		var err error
		if v.Worlds, err = cl.Worlds(ctx); err == nil {
			v.Consumers, err = cl.Consumers(ctx)
		}
		code := http.StatusOK
		if err != nil {
			code, v.Error = http.StatusBadGateway, err.Error()
		}
		if isAPI(r) {
			writeJSON(w, code, v)
			return
		}
		render(w, code, "commits", v)
	}
}

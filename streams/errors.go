package streams

import (
	"context"
	"errors"

	"github.com/jackc/pgx/v5/pgconn"
)

// Transient reports whether a failed batch is worth retrying as it is. Data
// errors (SQLSTATE classes 22 and 23) and projector panics are permanent:
// the same input fails again. Everything else counts as transient (the database or network was
// away, a transaction lost a race, a server shut down, but also a bug or a
// missing migration): the consumer holds back, visible as lag, instead of
// dead-lettering good messages.
func Transient(err error) bool {
	if err == nil || errors.Is(err, context.Canceled) {
		return false
	}
	var panicked *PanicError
	if errors.As(err, &panicked) {
		return false
	}
	var pe *pgconn.PgError
	if errors.As(err, &pe) {
		class := pe.Code[:2]
		return class != "22" && class != "23"
	}
	return true
}

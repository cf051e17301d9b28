package console

import (
	"context"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/millrace/millrace/internal/apikey"
)

type fakeCommitLog struct{ err error }

func (f fakeCommitLog) Worlds(context.Context) ([]World, error) {
	at := time.Now().Add(-90 * time.Second)
	return []World{{World: "prod/eu", Documents: 10, Versions: 40, Checkpoint: 77, CheckpointAt: &at, Pending: 3, OldestPending: &at}}, f.err
}

func (f fakeCommitLog) Consumers(context.Context) ([]ConsumerLag, error) {
	return []ConsumerLag{{Kind: "export", Stream: "BES", Consumer: "export-kafka-bes", Position: 5, Pending: 2, LastSeq: 9}}, nil
}

// The commit-log page shows an operator each world's checkpoint and lag
// and the consumers' positions, needs no database, and says when the
// backbone does not answer.
func TestConsoleCommitLog(t *testing.T) {
	keys, _ := apikey.Parse(operatorKey+"\nacme="+acmeKey, KeySyntax)
	for _, c := range []struct {
		cl       CommitLog
		key      string
		code     int
		contains string
	}{
		{fakeCommitLog{}, operatorKey, http.StatusOK, "<code>prod/eu</code>"},
		{fakeCommitLog{}, operatorKey, http.StatusOK, "s ago</td>"},
		{fakeCommitLog{}, operatorKey, http.StatusOK, "export-kafka-bes"},
		{fakeCommitLog{}, acmeKey, http.StatusForbidden, "operator"},
		{fakeCommitLog{err: errors.New("nats: timeout")}, operatorKey, http.StatusBadGateway, "nats: timeout"},
		{nil, operatorKey, http.StatusNotImplemented, "serves no commit log"},
	} {
		mux := http.NewServeMux()
		Register(mux, Sources{DB: func() *pgxpool.Pool { return nil }, CommitLog: c.cl}) // no database
		srv := httptest.NewServer(&Guard{Console: Keys{keys}, Next: mux})
		req, _ := http.NewRequest("GET", srv.URL+"/commits", nil)
		req.SetBasicAuth("me", c.key)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		srv.Close()
		if resp.StatusCode != c.code || !strings.Contains(string(body), c.contains) {
			t.Errorf("%+v: %d, want %d with %q\n%s", c, resp.StatusCode, c.code, c.contains, body)
		}
	}
}

package streams

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// DefaultDeleteConcurrency is how many deletions DeleteMsgs keeps in flight
// when told 0: each is one JetStream API request, a lookup by sequence on
// the server, which serializes a stream's deletions anyway.
const DefaultDeleteConcurrency = 256

// deleteQuiet is how long DeleteMsgs waits for the next answer before it
// gives up on the rest.
const deleteQuiet = 10 * time.Second

// DeleteMsgs deletes the messages at seqs from stream, concurrency requests
// in flight (0: DefaultDeleteConcurrency; negative is an error). A message
// already gone, or a sequence past the stream's last, is fine: a deletion
// retried after a failure finds some done. It returns the first refusal
// (the stream does not exist, the stream denies deletes...).
//
// The requests are the API's own ({"seq":N,"no_erase":true} on
// <prefix>STREAM.MSG.DELETE.<stream>), published in a pipeline with one
// reply subject, rather than made one by one with jetstream.Stream's
// DeleteMsg: the compactor deletes about one message per changed document,
// and in a pass of updates the client's per-request contexts, timers, reply
// subscriptions and reflection-based JSON were most of its CPU, CPU the
// server then lacked on a small machine.
func DeleteMsgs(ctx context.Context, js jetstream.JetStream, stream string, seqs []uint64, concurrency int) error {
	switch {
	case concurrency < 0:
		return fmt.Errorf("delete messages of %s: concurrency %d is negative", stream, concurrency)
	case concurrency == 0:
		concurrency = DefaultDeleteConcurrency
	}
	if len(seqs) == 0 {
		return nil
	}
	if err := ctx.Err(); err != nil {
		return err // a request sent is a deletion done: none once ctx ended
	}
	subject := apiPrefix(js) + "STREAM.MSG.DELETE." + stream
	nc := js.Conn()
	inbox := nc.NewInbox()
	answers := make(chan *nats.Msg, concurrency)
	sub, err := nc.ChanSubscribe(inbox, answers)
	if err != nil {
		return fmt.Errorf("delete messages of %s: %w", stream, err)
	}
	defer sub.Unsubscribe()
	timer := time.NewTimer(deleteQuiet)
	defer timer.Stop()
	req := make([]byte, 0, 64)
	sent, got := 0, 0
	for got < len(seqs) {
		for sent < len(seqs) && sent-got < concurrency && ctx.Err() == nil {
			req = strconv.AppendUint(append(req[:0], `{"seq":`...), seqs[sent], 10)
			req = append(req, `,"no_erase":true}`...)
			if err := nc.PublishRequest(subject, inbox, req); err != nil {
				return fmt.Errorf("delete message %d of %s: %w", seqs[sent], stream, err)
			}
			sent++
		}
		select {
		case m := <-answers:
			got++
			if err := deleteAnswer(m); err != nil {
				return fmt.Errorf("delete messages of %s: %w", stream, err)
			}
			timer.Reset(deleteQuiet)
		case <-timer.C:
			return fmt.Errorf("delete messages of %s: %d of %d deletions unanswered for %s", stream, sent-got, len(seqs), deleteQuiet)
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	return nil
}

// deleteAnswer reads the answer to a deletion: nil when the message is
// deleted or was already gone.
func deleteAnswer(m *nats.Msg) error {
	if m.Header.Get("Status") == "503" {
		return nats.ErrNoResponders // no JetStream answers on the prefix
	}
	data := m.Data
	if bytes.Contains(data, []byte(`"success":true`)) {
		return nil
	}
	var resp struct {
		Error *jetstream.APIError `json:"error"`
	}
	if err := json.Unmarshal(data, &resp); err != nil || resp.Error == nil {
		return fmt.Errorf("unexpected answer %q", data)
	}
	switch {
	case resp.Error.ErrorCode == jetstream.JSErrCodeMessageNotFound,
		resp.Error.ErrorCode == errCodeSequenceNotFound,
		resp.Error.ErrorCode == errCodeMsgDeleteFailed && (strings.Contains(resp.Error.Description, "no message found") ||
			strings.Contains(resp.Error.Description, "stream store EOF")): // past the stream's last message
		return nil
	}
	return resp.Error
}

// JetStream API error codes the jetstream package does not name.
const (
	errCodeSequenceNotFound jetstream.ErrorCode = 10043 // "sequence N not found"
	errCodeMsgDeleteFailed  jetstream.ErrorCode = 10057 // the store's error: "no message found", "stream store EOF"...
)

// apiPrefix is the subject prefix of js's API requests, ending in a dot.
func apiPrefix(js jetstream.JetStream) string {
	o := js.Options()
	switch {
	case o.Domain != "":
		return "$JS." + o.Domain + ".API."
	case o.APIPrefix != "":
		return strings.TrimSuffix(o.APIPrefix, ".") + "."
	}
	return jetstream.DefaultAPIPrefix
}

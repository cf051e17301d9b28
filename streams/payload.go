package streams

import (
	"fmt"

	"github.com/nats-io/nats.go/jetstream"
)

// HeaderRoom is what a message needs beyond its body: the headers
// (Nats-Msg-Id, millrace's own) and the envelope around an event take a
// few hundred bytes; an edge keeps this much of the largest message free.
const HeaderRoom = 64 << 10

// PayloadLimit is the largest message the backbone carries into one
// stream, and the setting that bounds it, for an edge to fit its own
// limit below and to name what an operator would raise.
type PayloadLimit struct {
	// Bytes is the limit; 0 when nothing is known (no connection).
	Bytes int64
	// Setting names what sets Bytes, in the operator's words.
	Setting string
}

// Payload is the smaller of the NATS server's max_payload (as this
// connection learnt it from the server it reached) and st's max_msg_size.
// NATS refuses a larger message before it reaches the stream: the client
// fails the publish, the server closes the connection of one that sends it
// anyway. A stock server's max_payload is 1 MiB, and JetStream clusters are
// commonly left at it (ops/nats/ shows this project's configuration).
func (b *Backbone) Payload(st jetstream.Stream) PayloadLimit {
	var pl PayloadLimit
	if b != nil && b.Conn != nil {
		if n := b.Conn.MaxPayload(); n > 0 {
			pl = PayloadLimit{Bytes: n, Setting: fmt.Sprintf("the NATS server's max_payload (%d bytes)", n)}
		}
	}
	if st == nil {
		return pl
	}
	c := st.CachedInfo().Config
	if n := int64(c.MaxMsgSize); n > 0 && (pl.Bytes == 0 || n < pl.Bytes) {
		pl = PayloadLimit{Bytes: n, Setting: fmt.Sprintf("the %s stream's max_msg_size (%d bytes, --nats-max-payload)", c.Name, n)}
	}
	return pl
}

// Room is what a body may take of the limit once HeaderRoom is kept free;
// 0 when nothing is known.
func (pl PayloadLimit) Room() int {
	if pl.Bytes <= HeaderRoom {
		return 0
	}
	return int(pl.Bytes - HeaderRoom)
}

// Fit is what an edge's own limit (limit bytes of body or event) becomes
// under pl: limit itself when pl leaves room for it or nothing is known,
// else pl.Room(), with lowered true. A pl that leaves less than 1 KiB
// beside HeaderRoom is an error: nothing useful would fit.
func (pl PayloadLimit) Fit(limit int) (fitted int, lowered bool, err error) {
	if pl.Bytes == 0 {
		return limit, false, nil
	}
	room := pl.Room()
	if room < 1<<10 {
		return limit, false, fmt.Errorf("%s leaves no room beside %d KiB of headers", pl.Setting, HeaderRoom>>10)
	}
	if limit <= room {
		return limit, false, nil
	}
	return room, true, nil
}

package archive_test

import (
	"bytes"
	"fmt"
	"io"
	"time"

	"github.com/millrace/millrace/archive"
)

// An object written as a stream and read back as projection.Messages, in
// stream order, every header kept.
func Example() {
	var obj bytes.Buffer
	w, _ := archive.NewWriter(&obj, nil, archive.Level)
	for seq := uint64(7); seq <= 9; seq++ {
		w.Write(&archive.Message{Sequence: seq, Stored: time.Unix(1700000000, 0), SubjectName: "bes.p.inv",
			Headers: map[string][]string{"Millrace-Kind": {"tool"}}, Payload: []byte{byte(seq)}})
	}
	w.Close()

	r, err := archive.NewReader(&obj, nil) // no dictionary: a loader is not needed
	if err != nil {
		panic(err)
	}
	defer r.Close()
	for {
		m, err := r.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			panic(err) // ErrCorrupt, ErrTruncated, ErrDictMissing
		}
		fmt.Println(m.Seq(), m.Subject(), m.Header("Millrace-Kind"), m.Data())
	}
	fmt.Printf("%+v\n", r.Stats().Messages)
	// Output:
	// 7 bes.p.inv tool [7]
	// 8 bes.p.inv tool [8]
	// 9 bes.p.inv tool [9]
	// 3
}

package layout

import (
	"bytes"
	"testing"
	"time"
)

func TestRecordFileRoundTrip(t *testing.T) {
	at := time.Date(2026, 11, 30, 1, 2, 3, 4, time.UTC)
	recs := []Record{
		{ID: "a", Version: 1, Time: at, Body: []byte("one")},
		{ID: "ドキュメント/\x00", Version: 1 << 40, Deleted: true, Time: at},
		{ID: "z", Version: 7, Time: at, Body: bytes.Repeat([]byte{0xff}, 100_000)},
	}
	for _, kind := range []byte{KindShard, KindHistory} {
		got, err := Decode(kind, Encode(kind, recs))
		if err != nil {
			t.Fatal(err)
		}
		if len(got) != len(recs) {
			t.Fatalf("%d records back, want %d", len(got), len(recs))
		}
		for i := range recs {
			w, g := recs[i], got[i]
			if g.ID != w.ID || g.Version != w.Version || g.Deleted != w.Deleted || !g.Time.Equal(w.Time) || !bytes.Equal(g.Body, w.Body) {
				t.Errorf("record %d: %+v, want %+v", i, g, w)
			}
		}
	}
	if _, err := Decode(KindHistory, Encode(KindShard, recs)); err == nil {
		t.Fatal("a shard decoded as a history segment")
	}
	if got, err := Decode(KindShard, Encode(KindShard, nil)); err != nil || len(got) != 0 {
		t.Fatalf("empty file: %v, %v", got, err)
	}
}

// FuzzDecode: whatever the bucket holds, decode returns records or an
// error, within its limits, and never panics.
func FuzzDecode(f *testing.F) {
	f.Add(Encode(KindShard, []Record{{ID: "a", Version: 1, Body: []byte("x")}}))
	f.Add(Encode(KindShard, nil))
	f.Add([]byte("MRC1S"))
	f.Add(encoder().EncodeAll([]byte("MRC1S\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01"), nil))
	f.Add(encoder().EncodeAll([]byte("MRC1S\x01a\x01\x00\x00\x80\x80\x80\x80\x01"), nil))
	f.Fuzz(func(t *testing.T, data []byte) {
		recs, err := Decode(KindShard, data)
		if err != nil {
			return
		}
		for _, r := range recs {
			if len(r.ID) > maxIDBytes || len(r.Body) > maxBodyBytes {
				t.Fatalf("record over the limits: id %d bytes, body %d", len(r.ID), len(r.Body))
			}
		}
		// What decodes re-encodes to the same records.
		again, err := Decode(KindShard, Encode(KindShard, recs))
		if err != nil || len(again) != len(recs) {
			t.Fatalf("re-encoded: %d records, %v", len(again), err)
		}
	})
}

package knob

import (
	"testing"
	"time"
)

func TestNotNegative(t *testing.T) {
	for _, c := range []struct {
		err  error
		want string
	}{
		{NotNegative("bes", "MaxEventBytes", -5, 4<<20), "bes: MaxEventBytes -5 is negative; set 0 for the default (4 MiB) or a positive size"},
		{NotNegative("fleet", "HelloTimeout", -time.Second, 10*time.Second), "fleet: HelloTimeout -1s is negative; set 0 for the default (10s) or a positive duration"},
		{NotNegative("fleet", "HandshakeRate", -0.5, 1000), "fleet: HandshakeRate -0.5 is negative; set 0 for the default (1000) or a positive number"},
		{NotNegative("bes", "MaxStreamsPerProject", -1, "MaxStreams/2"), "bes: MaxStreamsPerProject -1 is negative; set 0 for the default (MaxStreams/2) or a positive number"},
		{NotNegative("kafka", "BatchMaxBytes", int32(-1), int32(1000)), "kafka: BatchMaxBytes -1 is negative; set 0 for the default (1000 bytes) or a positive size"},
		{NotNegative("", "-rate", -2.5, "flat out"), "-rate -2.5 is negative; set 0 for the default (flat out) or a positive number"},
	} {
		if c.err == nil || c.err.Error() != c.want {
			t.Errorf("got %v\nwant %s", c.err, c.want)
		}
	}
	if err := NotNegative("x", "Zero", 0, 1); err != nil {
		t.Errorf("zero: %v", err)
	}
	if err := NotNegative("x", "Positive", time.Second, time.Minute); err != nil {
		t.Errorf("positive: %v", err)
	}
}

func TestBytes(t *testing.T) {
	for n, want := range map[int64]string{0: "0 bytes", 100: "100 bytes", 64 << 10: "64 KiB", 4 << 20: "4 MiB", 1536: "1536 bytes"} {
		if got := Bytes(n); got != want {
			t.Errorf("Bytes(%d) = %q, want %q", n, got, want)
		}
	}
}

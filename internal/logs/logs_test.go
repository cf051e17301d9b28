package logs

import (
	"bytes"
	"encoding/json"
	"errors"
	"flag"
	"log/slog"
	"os"
	"strings"
	"testing"

	"github.com/millrace/millrace/internal/envflag"
)

// The flags' defaults are info and text; the level filters, the format
// picks the handler.
func TestLogger(t *testing.T) {
	t.Setenv("MILLRACE_LOG_LEVEL", "warn")
	var o Options
	fs := flag.NewFlagSet("t", flag.ContinueOnError)
	o.RegisterFlags(fs)
	if err := fs.Parse([]string{"-log-format", "json"}); err != nil {
		t.Fatal(err)
	}
	var buf bytes.Buffer
	l, err := o.logger(&buf)
	if err != nil {
		t.Fatal(err)
	}
	l.Info("dropped")
	l.Warn("kept", "addr", "x")
	var line map[string]any
	if err := json.Unmarshal(buf.Bytes(), &line); err != nil || line["msg"] != "kept" || line["addr"] != "x" {
		t.Fatalf("warn and json gave %q (%v)", buf.String(), err)
	}

	os.Unsetenv("MILLRACE_LOG_LEVEL") // t.Setenv restores it
	t.Setenv("MILLRACE_LOG_FORMAT", "")
	os.Unsetenv("MILLRACE_LOG_FORMAT")
	var def Options
	def.RegisterFlags(flag.NewFlagSet("t", flag.ContinueOnError))
	buf.Reset()
	if l, err = def.logger(&buf); err != nil {
		t.Fatal(err)
	}
	l.Debug("dropped")
	l.Info("kept")
	if def.Level != "info" || def.Format != "text" || !strings.HasPrefix(buf.String(), "time=") || !strings.Contains(buf.String(), "msg=kept") || strings.Contains(buf.String(), "dropped") {
		t.Fatalf("format %q gave %q", def.Format, buf.String())
	}
}

// Logger makes slog's default the logger it returns.
func TestLoggerIsTheDefault(t *testing.T) {
	was := slog.Default()
	defer slog.SetDefault(was)
	l, err := Options{Level: "error", Format: "text"}.Logger()
	if err != nil || slog.Default() != l {
		t.Fatalf("Logger: %v, default %p, want %p", err, slog.Default(), l)
	}
}

// A level or format it does not know is a usage error naming the value.
func TestLoggerRefuses(t *testing.T) {
	for _, c := range []struct {
		o    Options
		want string
	}{
		{Options{Level: "loud", Format: "text"}, `log level "loud": want debug, info, warn or error`},
		{Options{Level: "info", Format: "xml"}, `log format "xml": want text or json`},
	} {
		l, err := c.o.Logger()
		if l != nil || !errors.As(err, new(envflag.UsageError)) || err.Error() != c.want {
			t.Errorf("%+v: %v, %v; want the usage error %q", c.o, l, err, c.want)
		}
	}
}

package fleet

import (
	"reflect"
	"strings"
	"testing"
	"time"
)

// TestNewRefusesNegatives: a negative limit, rate or duration is an
// operator's mistake, refused at start with a message naming the field.
func TestNewRefusesNegatives(t *testing.T) {
	tc, err := testCA().ServerTLS(nil)
	if err != nil {
		t.Fatal(err)
	}
	var cfg Config
	typ := reflect.TypeOf(cfg)
	n := 0
	for i := range typ.NumField() {
		f := typ.Field(i)
		switch f.Type.Kind() {
		case reflect.Int, reflect.Int64, reflect.Float64:
		default:
			continue
		}
		n++
		cfg := Config{CA: testCA(), TLS: tc, GatewayID: "gw"}
		v := reflect.ValueOf(&cfg).Elem().Field(i)
		if v.CanFloat() {
			v.SetFloat(-1)
		} else {
			v.SetInt(-1)
		}
		// No publisher: the config is refused before it is needed.
		_, err := New(cfg, nil, nil, nil, nil)
		if err == nil || !strings.Contains(err.Error(), "fleet: "+f.Name+" -1") || !strings.Contains(err.Error(), "set 0 for the default") {
			t.Errorf("%s negative: New returned %v, want an error naming it and saying what to set", f.Name, err)
		}
	}
	if n < 20 {
		t.Fatalf("only %d numeric fields found in Config", n)
	}
}

func TestNewTakesDefaults(t *testing.T) {
	b := newBackbone(t)
	cfg := startGateway(t, b, Config{}).srv.Config()
	for name, c := range map[string]struct{ got, want any }{
		"NodeCertValidity":    {cfg.NodeCertValidity, DefaultNodeCertValidity},
		"MaxSessions":         {cfg.MaxSessions, DefaultMaxSessions},
		"HandshakeRate":       {cfg.HandshakeRate, float64(DefaultHandshakeRate)},
		"HandshakeBurst":      {cfg.HandshakeBurst, DefaultHandshakeBurst},
		"JoinRatePerClient":   {cfg.JoinRatePerClient, float64(DefaultJoinRatePerClient)},
		"JoinBurstPerClient":  {cfg.JoinBurstPerClient, DefaultJoinBurstPerClient},
		"JoinRate":            {cfg.JoinRate, float64(DefaultJoinRate)},
		"JoinBurst":           {cfg.JoinBurst, DefaultJoinBurst},
		"TLSHandshakeTimeout": {cfg.TLSHandshakeTimeout, DefaultTLSHandshakeTimeout},
		"DenyListCheck":       {cfg.DenyListCheck, DefaultDenyListCheck},
		"MaxHellosInFlight":   {cfg.MaxHellosInFlight, DefaultMaxHellosInFlight},
		"HelloTimeout":        {cfg.HelloTimeout, DefaultHelloTimeout},
		"HeartbeatInterval":   {cfg.HeartbeatInterval, DefaultHeartbeatInterval},
		"HeartbeatTimeout":    {cfg.HeartbeatTimeout, 3 * DefaultHeartbeatInterval},
		"FlushInterval":       {cfg.FlushInterval, DefaultFlushInterval},
		"ResyncEvery":         {cfg.ResyncEvery, DefaultResyncEvery},
		"BindWindow":          {cfg.BindWindow, DefaultBindWindow},
		"MaxMessageBytes":     {cfg.MaxMessageBytes, DefaultMaxMessageBytes},
		"PublishTimeout":      {cfg.PublishTimeout, DefaultPublishTimeout},
		"PublishQueue":        {cfg.PublishQueue, DefaultPublishQueue},
		"MaxRetryAfter":       {cfg.MaxRetryAfter, DefaultMaxRetryAfter},
		"ReportRate":          {cfg.ReportRate, float64(DefaultReportRate)},
		"ReportBurst":         {cfg.ReportBurst, DefaultReportBurst},
		"MaxHeldAllocations":  {cfg.MaxHeldAllocations, DefaultMaxHeld},
		"SessionQueueShare":   {cfg.SessionQueueShare, DefaultSessionQueueShare},
	} {
		if c.got != c.want {
			t.Errorf("%s = %v, want the default %v", name, c.got, c.want)
		}
	}
	if d := (Config{HelloTimeout: time.Second}).withDefaults(); d.TLSHandshakeTimeout != time.Second {
		t.Errorf("TLSHandshakeTimeout %v with a 1s HelloTimeout, want 1s", d.TLSHandshakeTimeout)
	}
}

package redact

import "testing"

// BenchmarkBuildEvent redacts every event of the recorded real Bazel builds
// (loadtest/fixtures); one op is one event.
//
//	go test -run '^$' -bench BuildEvent -benchmem ./services/bes/redact/
func BenchmarkBuildEvent(b *testing.B) {
	evs := fixtureEvents(b)
	r := MustNew(Config{Allow: DefaultAllow})
	var bytes int64
	for _, ev := range evs {
		bytes += int64(len(ev))
	}
	b.SetBytes(bytes / int64(len(evs)))
	b.ReportAllocs()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		r.BuildEvent(evs[i%len(evs)])
	}
}

// BenchmarkBuildEventSecrets: events full of secrets, the slow path.
func BenchmarkBuildEventSecrets(b *testing.B) {
	evs, _ := secretEvents(b)
	r := MustNew(Config{Allow: DefaultAllow})
	b.ReportAllocs()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		r.BuildEvent(evs[i%len(evs)])
	}
}

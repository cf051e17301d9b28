package bes

import (
	buildpb "google.golang.org/genproto/googleapis/devtools/build/v1"

	"github.com/millrace/millrace/schemas/bep"
)

// redact replaces a build event's secrets by redact.Marker in place, before
// the event is encoded and published: what JetStream stores (and so every
// projection, the archive and the Kafka export) is what Bazel sent less its
// secrets. Only Bazel's BuildEvent is rewritten, by its known schema; a
// bazel_event of another type URL, and lifecycle events (ids, status and
// times only), pass as they are.
func (s *Server) redact(obe *buildpb.OrderedBuildEvent) {
	if s.cfg.NoRedaction {
		return
	}
	ev := obe.GetEvent().GetBazelEvent()
	if ev == nil || ev.GetTypeUrl() != bep.TypeURL {
		return
	}
	if out, changed := s.cfg.Redactor.BuildEvent(ev.Value); changed {
		ev.Value = out
		s.m.redacted.Inc()
	}
}

package bes

import (
	buildpb "google.golang.org/genproto/googleapis/devtools/build/v1"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/millrace/millrace/schemas/bep"
)

// redact replaces a build event's secrets by redact.Marker in place, before
// the event is encoded and published: what JetStream stores (and so every
// projection, the archive and the Kafka export) is what Bazel sent less its
// secrets. Only Bazel's BuildEvent is rewritten, by its known schema; a
// bazel_event of another type URL, and lifecycle events (ids, status and
// times only), pass as they are.
//
// Markers can be longer than what they replace (a://b@ becomes
// a://<redacted>@), so an event is measured again: one that would grow
// past the size limit is refused like an oversized one (it would be on
// every retry), never published above the backbone's max payload.
func (s *Server) redact(obe *buildpb.OrderedBuildEvent) error {
	if s.cfg.NoRedaction {
		return nil
	}
	ev := obe.GetEvent().GetBazelEvent()
	if ev == nil || ev.GetTypeUrl() != bep.TypeURL {
		return nil
	}
	out, changed := s.cfg.Redactor.BuildEvent(ev.Value)
	if !changed {
		return nil
	}
	if len(out) > s.cfg.MaxEventBytes {
		return status.Errorf(codes.InvalidArgument, "millrace: event %d is %d bytes once its secrets are redacted, over the limit of %d bytes (%s)",
			obe.GetSequenceNumber(), len(out), s.cfg.MaxEventBytes, s.cfg.raise())
	}
	ev.Value = out
	s.m.redacted.Inc()
	return nil
}

// Package bep holds Go types for the subset of Bazel's Build Event Protocol
// (package build_event_stream) that millrace reads. They are generated from
// schemas/proto/build_event_stream.proto by schemas/gen.sh (`make proto`);
// do not edit the .pb.go files.
//
// The types are wire-compatible with Bazel's own build_event_stream.proto:
// same message full names, field numbers and wire types. Fields Bazel sends
// that are not modelled here survive a decode as unknown fields, so a
// BuildEvent decoded with these types and encoded again keeps every byte of
// information.
//
// In a Build Event Service stream, each tool event's bazel_event is a
// google.protobuf.Any whose type URL is TypeURL and whose value is a
// BuildEvent.
package bep

// TypeURL is the google.protobuf.Any type URL of a BuildEvent in a BES
// bazel_event.
const TypeURL = "type.googleapis.com/build_event_stream.BuildEvent"

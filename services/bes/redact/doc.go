// Package redact removes secrets from Bazel's build events before they are
// stored: the values of header flags (--remote_header, --bes_header, any
// --*_header), of environment flags (--action_env, --test_env, --repo_env,
// --client_env, --host_action_env) and of --build_metadata, credentials in
// URLs (scheme://user:token@host), and well-known token shapes (GitHub,
// GitLab, Slack, AWS access keys, Google API keys, PEM private keys, JWTs),
// plus any patterns an operator adds. A flag's or variable's name always
// survives; only its value becomes Marker.
//
// BuildEvent rewrites an encoded build_event_stream.BuildEvent by walking
// its wire format with a table of the fields that can hold command lines,
// metadata or free text (see schema.go): nothing is decoded into Go types,
// fields it does not know are copied byte for byte, and an event with no
// secret is returned as it came, without a copy. Each string is first
// scanned for the cheap anchors every rule needs ('=' and "--" in command
// lines; "ghp_", "AKIA", "eyJ", "://...@", "-----BEGIN", ... in text) so
// that the regular expressions run only on the few strings that might
// match; on real builds that keeps the cost to a fraction of what the edge
// already spends per event (see redact_bench_test.go).
//
// Redaction is idempotent: a redacted event redacted again is unchanged,
// so events stored before and after an upgrade, and rows scrubbed twice,
// agree. The package imports nothing of NATS or PostgreSQL: the BES edge
// calls it on every event before publishing it, and `millrace builds scrub`
// calls Text on rows projected before redaction existed.
package redact

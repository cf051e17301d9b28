// Package subjects owns millrace's names on the backbone as plain strings:
// the stream names, the subject of each message family and the filters of
// their consumers, the token encoding that makes any id one safe subject
// token (Token, Untoken), the parsers that read ids back out of a subject,
// and NATS subject-pattern matching ('*' one token, a final '>' one or
// more).
//
// It imports nothing but the standard library, and no NATS in particular
// (internal/deps pins it), so that projectors, which never see NATS, use the
// same names and the same encoding as the edges that publish: before, the
// placer and the liveness projector each kept a copy of a subject or of the
// encoding, which had to be changed in step with the one in streams. The
// stream specs (retention, limits) stay in streams, which speaks to
// JetStream; docs/subjects.md describes the subjects as an interface.
package subjects

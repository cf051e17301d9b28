// Package kafka exports stream messages to Kafka topics with franz-go: a
// projection.Exporter that streams.ExportRunner drives, acknowledging each
// JetStream message only after Kafka acknowledged its record.
package kafka

import (
	"fmt"
	"strings"

	"github.com/millrace/millrace/subjects"
)

// Route sends the messages whose subjects match Filter (a NATS subject
// pattern: '*' matches one token, a final '>' one or more) to Topic.
type Route struct {
	Filter string
	Topic  string
}

// ParseRoutes reads routes written "filter -> topic", separated by commas
// or newlines, for example "bes.> -> millrace.bes, commits.> ->
// millrace.commits". The first route that matches a subject takes it.
func ParseRoutes(s string) ([]Route, error) {
	var out []Route
	for _, f := range strings.FieldsFunc(s, func(r rune) bool { return r == ',' || r == '\n' }) {
		f = strings.TrimSpace(f)
		if f == "" || strings.HasPrefix(f, "#") {
			continue
		}
		filter, topic, ok := strings.Cut(f, "->")
		filter, topic = strings.TrimSpace(filter), strings.TrimSpace(topic)
		if !ok || filter == "" || topic == "" {
			return nil, fmt.Errorf("kafka: route %q is not \"subject.pattern.> -> topic\"", f)
		}
		if err := subjects.CheckPattern(filter); err != nil {
			return nil, fmt.Errorf("kafka: route %q: %w", f, err)
		}
		if err := checkTopic(topic); err != nil {
			return nil, fmt.Errorf("kafka: route %q: %w", f, err)
		}
		out = append(out, Route{Filter: filter, Topic: topic})
	}
	if len(out) == 0 {
		return nil, fmt.Errorf("kafka: no routes in %q", s)
	}
	return out, nil
}

// checkTopic applies Kafka's rules for topic names: 1-249 characters of
// ASCII letters, digits, '.', '_' and '-', and not "." or "..".
func checkTopic(t string) error {
	if len(t) == 0 || len(t) > 249 || t == "." || t == ".." {
		return fmt.Errorf("topic %q: 1-249 characters, not \".\" or \"..\"", t)
	}
	for _, c := range t {
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '.' || c == '_' || c == '-') {
			return fmt.Errorf("topic %q: only ASCII letters, digits, '.', '_' and '-'", t)
		}
	}
	return nil
}

// Match reports whether subject matches the route's filter.
func (r Route) Match(subject string) bool { return subjects.Match(r.Filter, subject) }

// topicFor is the topic of the first route matching subject ("" if none).
func topicFor(routes []Route, subject string) string {
	for _, r := range routes {
		if r.Match(subject) {
			return r.Topic
		}
	}
	return ""
}

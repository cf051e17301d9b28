// Package kafka exports stream messages to Kafka topics with franz-go: a
// projection.Exporter that streams.ExportRunner drives, acknowledging each
// JetStream message only after Kafka acknowledged its record.
package kafka

import (
	"fmt"
	"strings"
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
		if err := checkFilter(filter); err != nil {
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

func checkFilter(f string) error {
	toks := strings.Split(f, ".")
	for i, t := range toks {
		switch {
		case t == "":
			return fmt.Errorf("subject pattern %q has an empty token", f)
		case t == ">" && i != len(toks)-1:
			return fmt.Errorf("subject pattern %q: '>' must be the last token", f)
		case strings.ContainsAny(t, " \t") || (len(t) > 1 && strings.ContainsAny(t, "*>")):
			return fmt.Errorf("subject pattern %q has a bad token %q", f, t)
		}
	}
	return nil
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
func (r Route) Match(subject string) bool { return matchSubject(r.Filter, subject) }

func matchSubject(filter, subject string) bool {
	for {
		ft, frest, fmore := strings.Cut(filter, ".")
		if ft == ">" {
			return subject != ""
		}
		st, srest, smore := strings.Cut(subject, ".")
		if ft != "*" && ft != st {
			return false
		}
		if !fmore || !smore {
			return fmore == smore
		}
		filter, subject = frest, srest
	}
}

// topicFor is the topic of the first route matching subject ("" if none).
func topicFor(routes []Route, subject string) string {
	for _, r := range routes {
		if r.Match(subject) {
			return r.Topic
		}
	}
	return ""
}

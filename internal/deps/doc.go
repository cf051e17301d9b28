// Package deps holds the test that keeps the dependency direction of the
// repository: edges do not import projectors, projectors import no NATS,
// the projection contract imports no NATS, the backbone does not import
// the commit log (nor its layout, which imports no NATS), the console
// reads projections and never the backbone, schemas imports nothing of
// ours. It also holds the test that every log attribute key of the
// repository is one of CONTRIBUTING.md's ("Logs and metrics").
package deps

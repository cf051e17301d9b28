// Package deps holds the test that keeps the dependency direction of the
// repository: edges do not import projectors, projectors import no NATS,
// the projection contract imports no NATS, the backbone does not import
// the commit log (nor its layout, which imports no NATS), schemas imports
// nothing of ours.
package deps

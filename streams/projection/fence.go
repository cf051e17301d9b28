package projection

import "context"

type fenceKey struct{}

// WithFence returns ctx carrying fence: the check a consumer's lease makes
// that its holder still holds it (streams.Held.Fence). The consumer core
// puts it in the context of everything it runs while it leads.
func WithFence(ctx context.Context, fence func(context.Context) error) context.Context {
	return context.WithValue(ctx, fenceKey{}, fence)
}

// Fence returns nil while the process running ctx still leads its
// consumer, and an error once it may not (its lease lapsed, was deleted,
// or another process took it). Code whose effect only the leader may
// have, and that commits it elsewhere than in the leader's own
// transaction, calls Fence just before: a folder before it writes a
// checkpoint or deletes folded versions. A context that carries no fence
// (a test, a one-off tool) always passes.
func Fence(ctx context.Context) error {
	if f, ok := ctx.Value(fenceKey{}).(func(context.Context) error); ok {
		return f(ctx)
	}
	return nil
}

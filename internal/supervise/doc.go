// Package supervise runs the components of one process: the backbone, the
// database pool, the edges, the consumers, the HTTP server. Every command
// of cmd/millrace that runs until a signal is a list of components given
// to Run.
//
// Components start one after the other, in the order given, and stop in
// the reverse order, all under one deadline (Config.ShutdownTimeout): a
// component may rely on every component before it for as long as it runs.
// There is one error path. The first component whose Start fails, or whose
// loop (Run) ends by itself, stops the process: the components already
// started stop in reverse, and its error is Run's. When ctx ends (the
// signal), the components stop the same way and Run returns nil; a Start
// that fails because ctx ended is a stop, not a failure.
//
// A component's loop runs on a context of its own that ends when the
// component is stopped, not when the signal comes, so that a consumer
// keeps running while the edges after it drain.
package supervise

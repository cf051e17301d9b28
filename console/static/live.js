// live.js: filled in by the live events (live.go).

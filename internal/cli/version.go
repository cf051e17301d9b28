package cli

import "runtime/debug"

// Version is the program's version: linked when the build set it (-ldflags
// "-X main.version=..."), else the module's version and VCS revision from
// the build information, else "(devel)".
func Version(linked string) string {
	v := linked
	if info, ok := debug.ReadBuildInfo(); ok && v == "" {
		v = info.Main.Version
		for _, s := range info.Settings {
			if s.Key == "vcs.revision" {
				v += " " + s.Value
			}
		}
	}
	if v == "" {
		v = "(devel)"
	}
	return v
}

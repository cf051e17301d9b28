package archive

import (
	"fmt"
	"strings"

	"github.com/millrace/millrace/subjects"
)

// BuildsPrefix is where build objects live in the bucket.
const BuildsPrefix = "archive/builds/"

// BuildKey is the key of a build's object: one per (project, invocation),
// both through subjects.Token (reversible, no '/', never "." or ".."), so
// a rewrite after late events replaces the object whole.
func BuildKey(project, invocation string) string {
	return BuildsPrefix + subjects.Token(project) + "/" + subjects.Token(invocation) + ".mrar"
}

// ParseBuildKey reverses BuildKey.
func ParseBuildKey(key string) (project, invocation string, err error) {
	rest, ok := strings.CutPrefix(key, BuildsPrefix)
	if ok {
		rest, ok = strings.CutSuffix(rest, ".mrar")
	}
	pt, it, ok2 := strings.Cut(rest, "/")
	if ok && ok2 {
		var ok3, ok4 bool
		project, ok3 = subjects.Untoken(pt)
		invocation, ok4 = subjects.Untoken(it)
		if ok3 && ok4 && BuildKey(project, invocation) == key {
			return project, invocation, nil
		}
	}
	return "", "", fmt.Errorf("archive: %q is not a build's key", key)
}

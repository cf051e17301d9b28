package fleet

import (
	"fmt"
	"runtime"
	"sort"
	"unsafe"
	_ "unsafe"
)

type gstack struct {
	lo, hi                   uintptr
	g0, g1, panic, defer_, m uintptr
	sp                       uintptr
}

//go:linkname allgs runtime.allgs
var allgs []unsafe.Pointer

func startFunc(g unsafe.Pointer) string {
	words := (*[60]uintptr)(g)
	name := "?"
	for i := 8; i < 60; i++ {
		if f := runtime.FuncForPC(words[i]); f != nil && f.Entry() == words[i] {
			name = f.Name()
		}
	}
	return name
}

func stackHistogram() string {
	h := map[string]int{}
	for _, g := range allgs {
		s := (*gstack)(g)
		h[fmt.Sprintf("%s %dB/used%d", startFunc(g), s.hi-s.lo, (s.hi-s.sp)/64*64)]++
	}
	var keys []string
	for k := range h {
		if h[k] > 100 {
			keys = append(keys, k)
		}
	}
	sort.Strings(keys)
	out := ""
	for _, k := range keys {
		out += fmt.Sprintf("\n  %s: %d", k, h[k])
	}
	return out
}

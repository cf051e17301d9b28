package subjects

import (
	"fmt"
	"testing"
)

func TestBESLayoutOneStream(t *testing.T) {
	var l BESLayout
	if l.N() != 1 || l.Partitioned() {
		t.Fatalf("zero layout: N %d, partitioned %v", l.N(), l.Partitioned())
	}
	if got := l.Subject("web", "a.b"); got != BES("web", "a.b") {
		t.Errorf("Subject = %q, want the one-stream subject %q", got, BES("web", "a.b"))
	}
	if l.Stream(0) != StreamBES || l.Filter(0) != BESFilter || l.Durable("builds", 0) != "builds" {
		t.Errorf("stream %q filter %q durable %q", l.Stream(0), l.Filter(0), l.Durable("builds", 0))
	}
	if got := l.ProjectFilter(0, "web"); got != BESProjectFilter("web") {
		t.Errorf("ProjectFilter = %q", got)
	}
	project, inv, p, ok := l.Parse(BES("we b", "i-1"))
	if !ok || project != "we b" || inv != "i-1" || p != 0 {
		t.Errorf("Parse = %q %q %d %v", project, inv, p, ok)
	}
}

func TestBESLayoutPartitioned(t *testing.T) {
	l := BESLayout{Partitions: 4}
	seen := map[int]int{}
	for i := range 400 {
		project, inv := "proj", fmt.Sprintf("inv-%d", i)
		p := l.Partition(project, inv)
		seen[p]++
		subj := l.Subject(project, inv)
		if want := fmt.Sprintf("bes.%d.proj.%s", p, inv); subj != want {
			t.Fatalf("Subject = %q, want %q", subj, want)
		}
		if !Match(l.Filter(p), subj) || !Match(l.ProjectFilter(p, project), subj) {
			t.Fatalf("%q is outside its partition's filters %q, %q", subj, l.Filter(p), l.ProjectFilter(p, project))
		}
		for q := range l.N() {
			if q != p && Match(l.Filter(q), subj) {
				t.Fatalf("%q matches partition %d's filter too", subj, q)
			}
		}
		gp, gi, gpart, ok := l.Parse(subj)
		if !ok || gp != project || gi != inv || gpart != p {
			t.Fatalf("Parse(%q) = %q %q %d %v", subj, gp, gi, gpart, ok)
		}
		if l.StreamOf(project, inv) != fmt.Sprintf("BES_%d", p) {
			t.Fatalf("StreamOf = %q", l.StreamOf(project, inv))
		}
	}
	if len(seen) != 4 {
		t.Fatalf("400 invocations fell in %d of 4 partitions: %v", len(seen), seen)
	}
	if got := l.Streams(); fmt.Sprint(got) != "[BES_0 BES_1 BES_2 BES_3]" {
		t.Errorf("Streams = %v", got)
	}
	if l.Durable("builds", 3) != "builds_3" {
		t.Errorf("Durable = %q", l.Durable("builds", 3))
	}
}

func TestBESLayoutParseRefuses(t *testing.T) {
	l := BESLayout{Partitions: 4}
	wrong := (l.Partition("p", "i") + 1) % 4
	for _, subj := range []string{
		"bes.p.i",                  // the one-stream shape
		"bes.4.p.i",                // out of range
		"bes.-1.p.i", "bes.01.p.i", // not the canonical number
		fmt.Sprintf("bes.%d.p.i", wrong), // not the partition the hash gives
		"bes.0.p.i.x", "commits.0.p.i",
	} {
		if _, _, _, ok := l.Parse(subj); ok {
			t.Errorf("Parse(%q) took it", subj)
		}
	}
	if _, _, _, ok := (BESLayout{}).Parse("bes.0.p.i"); ok {
		t.Error("the one-stream layout took a partitioned subject")
	}
}

func FuzzBESLayoutParse(f *testing.F) {
	f.Add("bes.1.proj.inv", 4)
	f.Add("bes.proj.inv", 1)
	f.Fuzz(func(t *testing.T, subj string, n int) {
		l := BESLayout{Partitions: n % 64}
		project, inv, p, ok := l.Parse(subj)
		if !ok {
			return
		}
		if got := l.Subject(project, inv); got != subj {
			t.Fatalf("Parse(%q) = %q %q, whose subject is %q", subj, project, inv, got)
		}
		if p != l.Partition(project, inv) {
			t.Fatalf("partition %d, want %d", p, l.Partition(project, inv))
		}
	})
}

package keyfile

import (
	"slices"
	"sync"
	"sync/atomic"
)

// Set is the list of parsed entries (key digests and what each admits to)
// behind a server's keys. Requests read it without a lock; a reload
// replaces it whole with Replace, so a request sees either the old keys or
// the new ones, never a mix, and a removed key is refused from the next
// request on. The zero value is empty and ready.
type Set[E any] struct {
	mu   sync.Mutex // serialises Add and Replace
	list atomic.Pointer[[]E]
}

// List returns the entries in force. The caller must not change it.
func (s *Set[E]) List() []E {
	if p := s.list.Load(); p != nil {
		return *p
	}
	return nil
}

// Len is the number of entries.
func (s *Set[E]) Len() int { return len(s.List()) }

// Add appends e to a copy, so that a reader holding the old list keeps it.
func (s *Set[E]) Add(e E) {
	s.mu.Lock()
	defer s.mu.Unlock()
	old := s.List()
	n := append(old[:len(old):len(old)], e)
	s.list.Store(&n)
}

// Replace makes s hold exactly the entries of from, at once.
func (s *Set[E]) Replace(from *Set[E]) {
	n := slices.Clone(from.List())
	s.mu.Lock()
	defer s.mu.Unlock()
	s.list.Store(&n)
}

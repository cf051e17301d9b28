package fleet

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"math/big"
	"os"
	"strings"
	"time"

	"google.golang.org/grpc/codes"
)

// Revocation. A node certificate is valid for NodeCertValidity (30 days by
// default); a leaked key or a decommissioned node must lose its access
// sooner than that. The gateway reads a deny list from a file and reloads
// it when the file changes (its modification time or size, checked every
// DenyListCheck): a revoked certificate's live session is closed with a
// "revoked" Refusal, its new sessions are refused, and a revoked node
// identity cannot Join again for a fresh certificate. A deny list rather
// than a CRL: the CA key stays where it is, an operator edits a text file
// (or a configuration system writes it), and every gateway of the fleet
// reads the same file.

// DefaultDenyListCheck is how often the deny list file is checked.
const DefaultDenyListCheck = time.Second

// DenyList is a parsed deny list: certificate serial numbers, and node
// identities (pool/node) whose every certificate is refused. The zero
// value and nil deny nothing.
type DenyList struct {
	serials map[string]struct{} // big.Int.Text(16) of the serial
	nodes   map[nodeKey]struct{}
}

// ParseDenyList reads a deny list: one entry per line, "#" starts a
// comment (a whole line or the rest of one). An entry with a "/" is a
// node identity, pool/node (split at the first "/"): every certificate of
// that node is refused. Any other entry is a certificate serial number in
// hexadecimal, as `openssl x509 -noout -serial` prints it ("serial="
// prefix, colons and case do not matter). A line that is neither is an error naming it, so a
// typo does not leave a certificate valid in silence.
func ParseDenyList(text string) (*DenyList, error) {
	d := &DenyList{serials: map[string]struct{}{}, nodes: map[nodeKey]struct{}{}}
	sc := bufio.NewScanner(strings.NewReader(text))
	sc.Buffer(make([]byte, 0, 4096), 1<<20)
	for n := 1; sc.Scan(); n++ {
		line := sc.Text()
		if i := strings.IndexByte(line, '#'); i >= 0 {
			line = line[:i]
		}
		line = strings.TrimSpace(line)
		if line == "" {
			continue
		}
		if pool, node, ok := strings.Cut(line, "/"); ok {
			pool, node = strings.TrimSpace(pool), strings.TrimSpace(node)
			if err := CheckID("pool", pool); err != nil {
				return nil, fmt.Errorf("fleet: deny list line %d (%q): %v", n, line, err)
			}
			if err := CheckID("node", node); err != nil {
				return nil, fmt.Errorf("fleet: deny list line %d (%q): %v", n, line, err)
			}
			d.nodes[nodeKey{pool: pool, node: node}] = struct{}{}
			continue
		}
		s, err := parseSerial(line)
		if err != nil {
			return nil, fmt.Errorf("fleet: deny list line %d (%q): %v", n, line, err)
		}
		d.serials[s] = struct{}{}
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("fleet: deny list: %w", err)
	}
	return d, nil
}

// parseSerial normalises a hexadecimal serial number.
func parseSerial(s string) (string, error) {
	s = strings.TrimPrefix(strings.TrimPrefix(s, "serial="), "0x")
	s = strings.ReplaceAll(s, ":", "")
	if s == "" || len(s) > 64 {
		return "", errors.New("not a certificate serial number (hexadecimal, at most 32 bytes) nor a pool/node identity")
	}
	v, ok := new(big.Int).SetString(s, 16)
	if !ok {
		return "", errors.New("not a certificate serial number (hexadecimal) nor a pool/node identity")
	}
	return v.Text(16), nil
}

// serialKey is the deny list's key of a certificate serial.
func serialKey(n *big.Int) string {
	if n == nil {
		return ""
	}
	return n.Text(16)
}

// Len is the number of entries.
func (d *DenyList) Len() int {
	if d == nil {
		return 0
	}
	return len(d.serials) + len(d.nodes)
}

// denies says whether a certificate (its serial) or the node it names is
// revoked, and which.
func (d *DenyList) denies(serial string, k nodeKey) (string, bool) {
	if d == nil {
		return "", false
	}
	if _, ok := d.nodes[k]; ok {
		return "node " + k.pool + "/" + k.node + " is revoked", true
	}
	if _, ok := d.serials[serial]; ok && serial != "" {
		return "certificate serial " + serial + " is revoked", true
	}
	return "", false
}

// denyFile is what was last read of the deny list file.
type denyFile struct {
	mod  time.Time
	size int64
}

// loadDenyList reads the deny list file (at New: an error stops the
// gateway from starting, since it would admit what the operator revoked).
func (s *Server) loadDenyList() error {
	if s.cfg.DenyListFile == "" {
		return nil
	}
	fi, err := os.Stat(s.cfg.DenyListFile)
	if err != nil {
		return fmt.Errorf("fleet: deny list: %w", err)
	}
	b, err := os.ReadFile(s.cfg.DenyListFile)
	if err != nil {
		return fmt.Errorf("fleet: deny list: %w", err)
	}
	d, err := ParseDenyList(string(b))
	if err != nil {
		return err
	}
	s.denied.Store(d)
	s.denyAt = denyFile{mod: fi.ModTime(), size: fi.Size()}
	s.m.denyEntries.Set(float64(d.Len()))
	return nil
}

// watchDenyList reloads the deny list whenever its file changes. A file
// that does not parse (or has gone) keeps the list in force: an editor's
// half-written file must not un-revoke anything.
func (s *Server) watchDenyList(ctx context.Context) {
	t := time.NewTicker(s.cfg.DenyListCheck)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		fi, err := os.Stat(s.cfg.DenyListFile)
		if err != nil {
			if s.denyErr != err.Error() {
				s.log.Error("deny list: keeping the list in force", "file", s.cfg.DenyListFile, "err", err)
				s.m.denyReloads.WithLabelValues("error").Inc()
			}
			s.denyErr = err.Error()
			continue
		}
		at := denyFile{mod: fi.ModTime(), size: fi.Size()}
		if at == s.denyAt {
			continue
		}
		b, err := os.ReadFile(s.cfg.DenyListFile)
		if err == nil {
			// A file being written in place (truncated, then written) may
			// be read half-way: read it again at the next check unless it
			// stayed the same while it was read.
			if fi, err := os.Stat(s.cfg.DenyListFile); err != nil || (denyFile{mod: fi.ModTime(), size: fi.Size()}) != at {
				continue
			}
		}
		s.denyAt = at
		var d *DenyList
		if err == nil {
			d, err = ParseDenyList(string(b))
		}
		if err == nil && d.Len() == 0 && s.denied.Load().Len() > 0 && len(bytes.TrimSpace(b)) == 0 {
			// An empty file is what a writer that truncates first leaves
			// for a moment; applied, it would admit every revoked node.
			err = errors.New("the file is empty; to clear the list, leave a comment line (#) in it")
		}
		if err != nil {
			s.log.Error("deny list does not parse: keeping the list in force", "file", s.cfg.DenyListFile, "err", err)
			s.m.denyReloads.WithLabelValues("error").Inc()
			s.denyErr = err.Error()
			continue
		}
		s.denyErr = ""
		s.m.denyReloads.WithLabelValues("ok").Inc()
		s.m.denyEntries.Set(float64(d.Len()))
		closed := s.applyDenyList(d)
		s.log.Info("deny list reloaded", "file", s.cfg.DenyListFile, "entries", d.Len(), "sessions_closed", closed)
	}
}

// applyDenyList puts d in force and closes the live sessions it revokes.
// The store comes before the sweep and handshake checks the list under
// s.mu as it registers a session: a session is either registered before
// the sweep (and closed by it) or checked against d.
func (s *Server) applyDenyList(d *DenyList) int {
	s.denied.Store(d)
	s.mu.Lock()
	var revoked []*session
	var reasons []string
	for k, sess := range s.sessions {
		if why, ok := d.denies(sess.certSerial, k); ok {
			revoked = append(revoked, sess)
			reasons = append(reasons, why)
		}
	}
	s.mu.Unlock()
	for i, sess := range revoked {
		s.m.revoked.WithLabelValues("session_closed").Inc()
		s.log.Warn("session closed: certificate revoked", "node", sess.key.node, "pool", sess.key.pool, "serial", sess.certSerial, "session", sess.id)
		sess.close(reasonRevoked, s.newRefusal(CodeRevoked, codes.PermissionDenied, "%s; ask an operator", reasons[i]), nil)
	}
	return len(revoked)
}

// revokedLocked checks a session about to be registered (s.mu held).
func (s *Server) revokedLocked(sess *session) *refusal {
	why, ok := s.denied.Load().denies(sess.certSerial, sess.key)
	if !ok {
		return nil
	}
	s.m.revoked.WithLabelValues("handshake_refused").Inc()
	return s.newRefusal(CodeRevoked, codes.PermissionDenied, "%s; ask an operator", why)
}

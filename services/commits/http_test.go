package commits

import (
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strings"
	"testing"
)

type httpClient struct {
	t   *testing.T
	srv *httptest.Server
	key string
}

func (c httpClient) do(method, path string, body string, hdr ...string) (*http.Response, string) {
	c.t.Helper()
	req, err := http.NewRequest(method, c.srv.URL+path, strings.NewReader(body))
	if err != nil {
		c.t.Fatal(err)
	}
	if c.key != "" {
		req.Header.Set("Authorization", "Bearer "+c.key)
	}
	for i := 0; i+1 < len(hdr); i += 2 {
		req.Header.Set(hdr[i], hdr[i+1])
	}
	res, err := http.DefaultClient.Do(req)
	if err != nil {
		c.t.Fatal(err)
	}
	defer res.Body.Close()
	b, _ := io.ReadAll(res.Body)
	return res, string(b)
}

func docPath(world, id string) string {
	return Prefix + url.PathEscape(world) + "/docs/" + url.PathEscape(id)
}

func TestHTTP(t *testing.T) {
	e := startEdge(t, Config{MaxBodyBytes: 100})
	srv := httptest.NewServer(e.srv.Handler())
	t.Cleanup(srv.Close)
	c := httpClient{t: t, srv: srv, key: keyW1}
	id := "dir/a b/é%.json"
	path := docPath("w1", id)

	res, body := c.do("PUT", path, `{"n":1}`, "If-None-Match", "*", "Idempotency-Key", "k1")
	var put struct {
		Version   uint64 `json:"version"`
		Duplicate bool   `json:"duplicate"`
	}
	if res.StatusCode != 200 || json.Unmarshal([]byte(body), &put) != nil || put.Version == 0 || res.Header.Get("ETag") != etag(put.Version) {
		t.Fatalf("create: %d %s %v", res.StatusCode, body, res.Header)
	}
	if res, body := c.do("PUT", path, `{"n":1}`, "If-None-Match", "*", "Idempotency-Key", "k1"); res.StatusCode != 200 || !strings.Contains(body, `"duplicate":true`) {
		t.Fatalf("resend: %d %s", res.StatusCode, body)
	}
	res, body = c.do("PUT", path, `{"n":2}`, "If-None-Match", "*")
	var conflict struct {
		Code           string `json:"code"`
		CurrentVersion uint64 `json:"current_version"`
	}
	if res.StatusCode != 409 || json.Unmarshal([]byte(body), &conflict) != nil || conflict.CurrentVersion != put.Version || conflict.Code != "FAILED_PRECONDITION" {
		t.Fatalf("create over an existing document: %d %s", res.StatusCode, body)
	}
	if res, body := c.do("PUT", path, `{"n":2}`, "If-Match", etag(put.Version)); res.StatusCode != 200 {
		t.Fatalf("put over the current version: %d %s", res.StatusCode, body)
	}
	res, body = c.do("GET", path, "")
	if res.StatusCode != 200 || body != `{"n":2}` || res.Header.Get(headerVersion) == "" || res.Header.Get("Content-Type") != "application/octet-stream" {
		t.Fatalf("get: %d %q %v", res.StatusCode, body, res.Header)
	}
	if res, body := c.do("GET", path+"?version="+itoa(put.Version), ""); res.StatusCode != 200 || body != `{"n":1}` {
		t.Fatalf("get version %d: %d %q", put.Version, res.StatusCode, body)
	}
	if res, _ := c.do("DELETE", path, "", "If-Match", `"1"`); res.StatusCode != 409 {
		t.Fatalf("delete over a stale version: %d", res.StatusCode)
	}
	if res, body := c.do("DELETE", path, ""); res.StatusCode != 200 {
		t.Fatalf("delete: %d %s", res.StatusCode, body)
	}
	if res, body := c.do("GET", path, ""); res.StatusCode != 404 || !strings.Contains(body, "deleted") {
		t.Fatalf("get after delete: %d %s", res.StatusCode, body)
	}
	res, body = c.do("GET", Prefix+"w1/history/"+url.PathEscape(id)+"?page_size=2", "")
	var h struct {
		Versions []struct {
			Version uint64 `json:"version"`
			Deleted bool   `json:"deleted"`
		} `json:"versions"`
		Next uint64 `json:"next_after_version"`
	}
	if res.StatusCode != 200 || json.Unmarshal([]byte(body), &h) != nil || len(h.Versions) != 2 || h.Next == 0 {
		t.Fatalf("history page 1: %d %s", res.StatusCode, body)
	}
	res, body = c.do("GET", Prefix+"w1/history/"+url.PathEscape(id)+"?after="+itoa(h.Next), "")
	h.Versions, h.Next = nil, 0
	if res.StatusCode != 200 || json.Unmarshal([]byte(body), &h) != nil || len(h.Versions) != 1 || !h.Versions[0].Deleted || h.Next != 0 {
		t.Fatalf("history page 2: %d %s", res.StatusCode, body)
	}

	for _, bad := range []struct {
		name, method, path, body string
		hdr                      []string
		key                      string
		want                     int
	}{
		{"no key", "GET", path, "", nil, "-", 401},
		{"another world", "GET", docPath("w2", "x"), "", nil, keyW1, 403},
		{"body over the limit", "PUT", path, strings.Repeat("x", 101), nil, keyW1, 413},
		{"bad If-Match", "PUT", path, "x", []string{"If-Match", "W/abc"}, keyW1, 400},
		{"If-None-Match not *", "PUT", path, "x", []string{"If-None-Match", `"3"`}, keyW1, 400},
		{"both conditions", "PUT", path, "x", []string{"If-Match", `"3"`, "If-None-Match", "*"}, keyW1, 400},
		{"id not UTF-8", "PUT", Prefix + "w1/docs/%FF%FE", "x", nil, keyW1, 400},
		{"bad version", "GET", path + "?version=zero", "", nil, keyW1, 400},
		{"unknown path", "GET", Prefix + "w1/nothing", "", nil, keyW1, 404},
	} {
		cc := c
		if cc.key = bad.key; bad.key == "-" {
			cc.key = ""
		}
		if res, body := cc.do(bad.method, bad.path, bad.body, bad.hdr...); res.StatusCode != bad.want || !strings.Contains(body, `"error"`) {
			t.Errorf("%s: %d %s, want %d with an error", bad.name, res.StatusCode, body, bad.want)
		}
	}
}

func itoa(v uint64) string { return strings.Trim(etag(v), `"`) }

// FuzzHTTP sends arbitrary paths, conditions and bodies: the edge answers
// every one with a status a client can act on (never a 5xx but 503, never
// a panic), and stores only what it acknowledged.
func FuzzHTTP(f *testing.F) {
	f.Add("PUT", "w1/docs/a", "*", "", "body")
	f.Add("PUT", "w1/docs/a%2Fb", "", `"1"`, "")
	f.Add("GET", "w1/docs/%FF", "", "", "")
	f.Add("DELETE", "w1/docs/..%2F..", "", `"0"`, "")
	f.Add("GET", "w1/history/a?after=18446744073709551615&page_size=4294967296", "", "", "")
	f.Add("PUT", "%00/docs/%00", "*", `"x"`, "\x00")
	e := startEdge(f, Config{MaxBodyBytes: 64})
	h := e.srv.Handler()
	f.Fuzz(func(t *testing.T, method, path, noneMatch, match, body string) {
		switch method {
		case "GET", "PUT", "DELETE":
		default:
			return
		}
		req, err := http.NewRequest(method, "http://edge"+Prefix+path, strings.NewReader(body))
		if err != nil {
			return
		}
		req.Header.Set("Authorization", "Bearer "+keyAll)
		if noneMatch != "" {
			req.Header.Set("If-None-Match", noneMatch)
		}
		if match != "" {
			req.Header.Set("If-Match", match)
		}
		w := httptest.NewRecorder()
		h.ServeHTTP(w, req)
		if w.Code >= 500 && w.Code != 503 {
			t.Fatalf("%s %s: %d %s", method, path, w.Code, w.Body.String())
		}
	})
}

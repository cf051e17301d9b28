package main

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/millrace/millrace/internal/testenv"
	commitspb "github.com/millrace/millrace/schemas/commits"
)

// TestCommitsInDev: `millrace dev` serves the commits API over gRPC and
// HTTP with its development key; a version acknowledged before the
// process is killed (SIGKILL) is there after the restart, and
// compare-and-set still holds against it.
func TestCommitsInDev(t *testing.T) {
	dev := newDev(t, testenv.Database(t))
	dev.start()
	keyFile := filepath.Join(dev.fleetDir, "commits-api-keys")
	waitUntil(t, "the development commits key", func() bool {
		b, err := os.ReadFile(keyFile) // written once; read it whole
		return err == nil && bytes.Contains(b, []byte("\n"))
	})
	b, err := os.ReadFile(keyFile)
	if err != nil {
		t.Fatal(err)
	}
	world, key, _ := strings.Cut(strings.TrimSpace(string(b)), "=")
	if world != "*" {
		t.Fatalf("development key for %q, want every world (*)", world)
	}
	conn, err := grpc.NewClient(dev.commitsAddr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	client := commitspb.NewCommitsClient(conn)
	ctx := metadata.AppendToOutgoingContext(context.Background(), "authorization", "Bearer "+key)
	var put *commitspb.PutResponse
	waitUntil(t, "the commits API", func() bool {
		put, err = client.Put(ctx, &commitspb.PutRequest{World: "e2e", Id: "doc 1", Body: []byte("v1"), ExpectedVersion: new(uint64)})
		return err == nil
	})

	// The same API over HTTP on the console's address.
	web := regexp.MustCompile(`msg="HTTP serving".*addr=(\S+)`).FindStringSubmatch(dev.output())
	if web == nil {
		t.Fatalf("no HTTP address in the log:\n%s", dev.output())
	}
	req, _ := http.NewRequest("GET", "http://"+web[1]+"/v1/worlds/e2e/docs/doc%201", nil)
	req.Header.Set("Authorization", "Bearer "+key)
	res, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(res.Body)
	res.Body.Close()
	if res.StatusCode != 200 || !bytes.Equal(body, []byte("v1")) || res.Header.Get("ETag") == "" {
		t.Fatalf("HTTP get: %d %q", res.StatusCode, body)
	}

	// The console's commit-log page: the world once folded, and the
	// compactor's position.
	var page struct {
		Worlds []struct {
			World      string
			Documents  int
			Checkpoint uint64 `json:"checkpoint_seq"`
		}
		Consumers []struct{ Kind, Consumer string }
	}
	waitUntil(t, "the world folded, on the console's commit-log page", func() bool {
		res, err := http.Get("http://" + web[1] + "/api/v1/commits")
		if err != nil {
			return false
		}
		defer res.Body.Close()
		page.Worlds = nil
		if json.NewDecoder(res.Body).Decode(&page) != nil || res.StatusCode != 200 {
			return false
		}
		return len(page.Worlds) == 1 && page.Worlds[0].World == "e2e" && page.Worlds[0].Documents == 1 && page.Worlds[0].Checkpoint > 0
	})
	if len(page.Consumers) == 0 || page.Consumers[0].Kind != "compactor" {
		t.Errorf("the commit-log page's consumers: %+v", page.Consumers)
	}

	dev.kill()
	dev.start()
	var d *commitspb.Document
	waitUntil(t, "the commits API after the restart", func() bool {
		d, err = client.Get(ctx, &commitspb.GetRequest{World: "e2e", Id: "doc 1"})
		return err == nil
	})
	if d.Version != put.Version || string(d.Body) != "v1" {
		t.Fatalf("after a kill: version %d %q, want %d \"v1\"", d.Version, d.Body, put.Version)
	}
	_, err = client.Put(ctx, &commitspb.PutRequest{World: "e2e", Id: "doc 1", Body: []byte("again"), ExpectedVersion: new(uint64)})
	if status.Code(err) != codes.FailedPrecondition {
		t.Fatalf("create over the document after the restart: %v, want FAILED_PRECONDITION", err)
	}

	// The compactor of dev (a 1 s interval here) folds the world into the
	// bucket and drops the replaced version from the stream; the edge then
	// reads it from the bucket, after a restart too, and lists the world.
	v2, err := client.Put(ctx, &commitspb.PutRequest{World: "e2e", Id: "doc 1", Body: []byte("v2"), ExpectedVersion: &put.Version})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := client.Put(ctx, &commitspb.PutRequest{World: "e2e", Id: "doc 2", Body: []byte("x")}); err != nil {
		t.Fatal(err)
	}
	folded := regexp.MustCompile(`msg=folded .*world=e2e versions=\d+ dropped=[1-9]`)
	deadline := time.Now().Add(60 * time.Second)
	for !folded.MatchString(dev.output()) {
		if time.Now().After(deadline) {
			t.Fatalf("no pass over world e2e dropped the replaced version:\n%s", dev.output())
		}
		time.Sleep(100 * time.Millisecond)
	}
	dev.kill()
	dev.start()
	waitUntil(t, "the folded version through the API", func() bool {
		d, err = client.Get(ctx, &commitspb.GetRequest{World: "e2e", Id: "doc 1", Version: put.Version})
		return err == nil
	})
	if string(d.Body) != "v1" {
		t.Fatalf("the folded version %d: %q, want \"v1\"", put.Version, d.Body)
	}
	h, err := client.History(ctx, &commitspb.HistoryRequest{World: "e2e", Id: "doc 1"})
	if err != nil || len(h.Versions) != 2 || h.Versions[0].Version != put.Version || h.Versions[1].Version != v2.Version {
		t.Fatalf("history of doc 1: %v, %v", h, err)
	}
	l, err := client.List(ctx, &commitspb.ListRequest{World: "e2e"})
	if err != nil || len(l.Docs) != 2 || l.Docs[0].Id != "doc 1" || l.Docs[0].Version != v2.Version || l.Docs[1].Id != "doc 2" {
		t.Fatalf("list of e2e: %v, %v", l, err)
	}
	// The process logs the open before it answers List, but its output
	// reaches the test through a pipe a moment later.
	opened := regexp.MustCompile(`msg="world opened" .*world=e2e checkpoint_docs=2 `)
	for deadline := time.Now().Add(10 * time.Second); !opened.MatchString(dev.output()); time.Sleep(50 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("List did not open the world from its checkpoint:\n%s", dev.output())
		}
	}
}

package main

import (
	"bytes"
	"context"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

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
	waitUntil(t, "the development commits key", func() bool { _, err := os.Stat(keyFile); return err == nil })
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
}

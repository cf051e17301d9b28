package reservations

import (
	"encoding/json"
	"net"
	"net/http"
	"net/http/httptest"
	"testing"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	fleetpb "github.com/millrace/millrace/schemas/fleet"
)

// Before its Server is Set, a Late answers every call UNAVAILABLE over
// gRPC and 503 with Retry-After over HTTP; after, the Server answers.
func TestLateBeforeAndAfterTheDatabase(t *testing.T) {
	e := newEnv(t, Config{})
	var l Late
	l.Close() // nothing to close yet
	g := grpc.NewServer()
	mux := http.NewServeMux()
	l.Register(g, mux)
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	go g.Serve(lis)
	t.Cleanup(g.Stop)
	conn, err := grpc.NewClient(lis.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	client := fleetpb.NewReservationsClient(conn)
	web := httptest.NewServer(mux)
	defer web.Close()
	get := func() *http.Response {
		req, _ := http.NewRequest("GET", web.URL+"/v1/reservations/r-none", nil)
		req.Header.Set("Authorization", "Bearer "+aliceKey)
		res, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		return res
	}

	_, err = client.Get(as(t, aliceKey), &fleetpb.GetReservationRequest{Id: "r-none"})
	if status.Code(err) != codes.Unavailable {
		t.Fatalf("gRPC before Set: %v, want UNAVAILABLE", err)
	}
	res := get()
	var body struct{ Code string }
	json.NewDecoder(res.Body).Decode(&body)
	res.Body.Close()
	if res.StatusCode != http.StatusServiceUnavailable || res.Header.Get("Retry-After") == "" || body.Code != "UNAVAILABLE" {
		t.Fatalf("HTTP before Set: %d, Retry-After %q, code %q", res.StatusCode, res.Header.Get("Retry-After"), body.Code)
	}

	l.Set(e.srv)
	_, err = client.Get(as(t, aliceKey), &fleetpb.GetReservationRequest{Id: "r-none"})
	if status.Code(err) != codes.NotFound {
		t.Fatalf("gRPC after Set: %v, want the Server's NOT_FOUND", err)
	}
	if res := get(); res.StatusCode != http.StatusNotFound {
		t.Fatalf("HTTP after Set: %d, want the Server's 404", res.StatusCode)
	}
}

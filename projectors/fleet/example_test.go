package fleet_test

import (
	"context"
	"fmt"
	"os"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/millrace/millrace/projectors/fleet"
)

// What a console page of one pool shows: its nodes by state, and which of
// them went unreachable in the last hour.
func ExampleNodes() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		panic(err)
	}
	defer pool.Close()
	nodes, err := fleet.Nodes(ctx, pool, "gpu-a")
	if err != nil {
		panic(err)
	}
	for _, n := range nodes {
		fmt.Printf("%-20s %-11s since %s, last seen %s via %q\n", n.ID, n.State,
			n.StateSince.Format(time.RFC3339), n.LastSeen.Format(time.RFC3339), n.GatewayID)
	}
	gone, err := fleet.Unreachable(ctx, pool, time.Now().Add(-time.Hour))
	if err != nil {
		panic(err)
	}
	fmt.Println("unreachable in the last hour:", gone)
}

// What `millrace fleet show <node> --pool a100` would print.
func ExampleShow() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		panic(err)
	}
	defer pool.Close()
	n, err := fleet.Show(ctx, pool, "a100", "gpu-node-0042")
	if err != nil {
		panic(err) // fleet.ErrNotFound for a node never connected
	}
	for _, d := range n.Devices {
		fmt.Printf("gpu %d: %s, %d MiB, %s\n", d.Index, d.Model, d.MemoryMiB, d.Health)
	}
}

package agent_test

import (
	"context"
	"log"
	"os"
	"os/signal"
	"time"

	"github.com/millrace/millrace/agent"
	fleetpb "github.com/millrace/millrace/schemas/fleet"
)

// A node daemon: join once, then hold a session until told to stop.
func Example() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	caPEM, err := os.ReadFile("/etc/millrace/fleet-ca.pem")
	if err != nil {
		log.Fatal(err)
	}
	id, err := agent.Join(ctx, "gateway-1.example:1986", os.Getenv("MILLRACE_JOIN_TOKEN"), "gpu-node-17", caPEM)
	if err != nil {
		log.Fatal(err) // agent.RetryAfter(err) says how long to wait when refused
	}
	// (Keep id.CertPEM and id.KeyPEM to skip the Join after a restart.)
	a, err := agent.New(agent.Config{
		Settings: &agent.Settings{
			Gateways:     []string{"gateway-1.example:1986", "gateway-2.example:1986"},
			TLS:          id.TLSConfig(),
			AgentVersion: "1.0.0",
		},
		NodeID:      "gpu-node-17",
		Pool:        id.Pool,
		Certificate: &id.Certificate,
		Labels:      map[string]string{"zone": "eu-1a"},
		GPUs: []*fleetpb.Gpu{
			{Index: 0, Model: "H100", MemoryMib: 81559, Health: fleetpb.GpuHealth_GPU_HEALTH_OK, Uuid: "GPU-5f1c..."},
		},
		Status: func() *fleetpb.StatusReport {
			return &fleetpb.StatusReport{Gpus: []*fleetpb.GpuState{{Index: 0, Health: fleetpb.GpuHealth_GPU_HEALTH_OK}}}
		},
		Bind: func(ctx context.Context, cmd *fleetpb.Command) error {
			// Hand the GPUs in cmd.GetBind() to the workload; an error
			// answers FAILED.
			return nil
		},
	})
	if err != nil {
		log.Fatal(err)
	}
	a.Start()
	<-ctx.Done()
	shutdown, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	a.Stop(shutdown)
}

package redact_test

import (
	"fmt"

	"github.com/millrace/millrace/services/bes/redact"
)

func ExampleRedactor_Arg() {
	r, err := redact.New(redact.Config{Allow: redact.DefaultAllow, Patterns: []string{`corp-[0-9a-f]{8}`}})
	if err != nil {
		panic(err)
	}
	for _, a := range []string{
		"--remote_header=Authorization=Bearer abc123",
		"--action_env=TOKEN=s3cr3t",
		"--client_env=PATH=/usr/bin:/bin",
		"--remote_cache=https://user:pw@cache.example.com",
		"--define=ID=corp-0badc0de",
		"--keep_going",
	} {
		fmt.Println(r.Arg(a))
	}
	fmt.Println(r.Text("export GH_TOKEN=ghp_Ab12Cd34Ef56Gh78Ij90Kl12Mn34Op56Qr78"))
	// Output:
	// --remote_header=Authorization=<redacted>
	// --action_env=TOKEN=<redacted>
	// --client_env=PATH=/usr/bin:/bin
	// --remote_cache=https://<redacted>@cache.example.com
	// --define=ID=<redacted>
	// --keep_going
	// export GH_TOKEN=<redacted>
}

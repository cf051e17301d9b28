package streams

import (
	"fmt"
	"io"
	"strconv"
	"strings"
)

// Environment variables the accounts configuration reads its users' public
// nkeys from (ops/nats/nats-server.conf lists them with the rest).
const (
	ServiceNKeyEnv = "MILLRACE_SERVICE_NKEY"
	ReaderNKeyEnv  = "MILLRACE_READER_NKEY"
	SystemNKeyEnv  = "NATS_SYSTEM_NKEY"
)

// AccountsDescription is the help of the command that prints WriteAccounts.
const AccountsDescription = "Prints the accounts block that ops/nats/nats-server.conf includes (ops/nats/accounts.conf): millrace's account\n" +
	"with JetStream, its service user and the read-only reader kept off the durable consumers millrace uses\n" +
	"(a compactor durable of your own: set MILLRACE_COMPACTOR_DURABLE). The users' nkeys are read by the\n" +
	"NATS server from its environment: $" + ServiceNKeyEnv + ", $" + ReaderNKeyEnv + ", $" + SystemNKeyEnv + "."

// AccountName is the NATS account millrace's streams live in on an
// external cluster.
const AccountName = "MILLRACE"

// WriteAccounts writes the accounts block of an external cluster's server
// configuration (ops/nats/accounts.conf is its output for the durables
// of a stock install): the two identities the embedded server admits
// (auth.go), in one account with JetStream, the reader with
// ReaderPermissions(c) so that it cannot touch c.ServiceConsumers, and a
// system account for the operators' `nats server` commands. The users'
// nkeys are the environment's (ServiceNKeyEnv, ReaderNKeyEnv,
// SystemNKeyEnv): the same file serves every node and no key is written
// into it.
func WriteAccounts(w io.Writer, c Config) error {
	p := ReaderPermissions(c)
	var b strings.Builder
	b.WriteString(`# NATS accounts of millrace's backbone, included by nats-server.conf.
# Written by ` + "`millrace streams accounts`" + `, which reads the durable consumers'
# names from the code (a compactor durable of your own: set
# MILLRACE_COMPACTOR_DURABLE when running it); edit the limits, not the lists.
# The users are nkeys: the service identity publishes and consumes (every
# millrace process, --nats-nkey with its seed), the reader only looks (the
# runbooks' nats commands: nats --nkey reader.nk).

accounts {
  ` + AccountName + ` {
    jetstream {
      max_file: -1
      max_mem: 256MB
    }
    users: [
      { nkey: $` + ServiceNKeyEnv + ` }
      {
        nkey: $` + ReaderNKeyEnv + `
        permissions {
          publish {
`)
	list(&b, "allow", p.Publish.Allow)
	list(&b, "deny", p.Publish.Deny)
	b.WriteString(`          }
          subscribe {
`)
	list(&b, "allow", p.Subscribe.Allow)
	b.WriteString(`          }
        }
      }
    ]
  }
  SYS {
    users: [
      { nkey: $` + SystemNKeyEnv + ` }
    ]
  }
}
system_account: SYS
`)
	_, err := io.WriteString(w, b.String())
	if err != nil {
		return fmt.Errorf("accounts: %w", err)
	}
	return nil
}

func list(b *strings.Builder, name string, subjects []string) {
	b.WriteString("            " + name + ": [\n")
	for _, s := range subjects {
		b.WriteString("              " + strconv.Quote(s) + "\n")
	}
	b.WriteString("            ]\n")
}

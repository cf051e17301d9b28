package redact

import (
	"bytes"
	"strings"
	"testing"

	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"

	"github.com/millrace/millrace/schemas/bep"
)

// Token shapes as the services issue them (made up, of the right form).
const (
	ghToken     = "ghp_Ab12Cd34Ef56Gh78Ij90Kl12Mn34Op56Qr78"
	ghPAT       = "github_pat_11ABCDEFG0123456789_abcdefghijklmnopqrstuvwxyz"
	glToken     = "glpat-Xy12Ab34Cd56Ef78Gh90"
	slackToken  = "xoxb-1234567890-abcdefghijkl"
	awsKey      = "AKIAIOSFODNN7EXAMPLE"
	awsTempKey  = "ASIAIOSFODNN7EXAMPLE"
	googleKey   = "AIzaSyA1234567890abcdefghijklmnopqrstuv"
	jwt         = "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.dozjgNryP4J3jVmNHl0w5N_XgL0n3I9PlFUP0THsR8U"
	pemKey      = "-----BEGIN RSA PRIVATE KEY-----\nMIIEowIBAAKCAQEA0Z3VS5JJcds3xfn\n-----END RSA PRIVATE KEY-----"
	pemRedacted = "-----BEGIN RSA PRIVATE KEY-----" + Marker + "-----END RSA PRIVATE KEY-----"
)

func TestArg(t *testing.T) {
	r := MustNew(Config{Allow: DefaultAllow})
	for _, c := range []struct{ in, want string }{
		{"--remote_header=Authorization=Bearer SECRET1", "--remote_header=Authorization=" + Marker},
		{"--bes_header=x-api-key=SECRET", "--bes_header=x-api-key=" + Marker},
		{"--remote_cache_header=SECRET", "--remote_cache_header=" + Marker},
		{"--remote_exec_header=A=B", "--remote_exec_header=A=" + Marker},
		{"--remote_downloader_header=A=B", "--remote_downloader_header=A=" + Marker},
		{"--action_env=TOKEN=SECRET2", "--action_env=TOKEN=" + Marker},
		{"--host_action_env=TOKEN=SECRET2", "--host_action_env=TOKEN=" + Marker},
		{"--test_env=TOKEN=SECRET2", "--test_env=TOKEN=" + Marker},
		{"--repo_env=TOKEN=SECRET2", "--repo_env=TOKEN=" + Marker},
		{"--client_env=TOKEN=SECRET2", "--client_env=TOKEN=" + Marker},
		{"--build_metadata=K=SECRET3", "--build_metadata=K=" + Marker},
		{"--action_env=TOKEN", "--action_env=TOKEN"}, // inherits the client's value: nothing to hide
		{"--action_env=EMPTY=", "--action_env=EMPTY="},
		{"--client_env=PATH=/usr/bin:/bin", "--client_env=PATH=/usr/bin:/bin"}, // allowed
		{"--client_env=LC_ALL=C", "--client_env=LC_ALL=C"},                     // allowed by LC_*
		{"--client_env=PATH=/x:" + ghToken, "--client_env=PATH=/x:" + Marker},  // allowed, still scanned
		{"--build_metadata=URL=https://u:SECRET4@host/x", "--build_metadata=URL=" + Marker},
		{"--remote_cache=https://u:SECRET4@cache.example:443", "--remote_cache=https://" + Marker + "@cache.example:443"},
		{"--bes_backend=grpcs://TOKEN@bes.example", "--bes_backend=grpcs://" + Marker + "@bes.example"},
		{"--default_override=0:build=--remote_header=Authorization=Bearer X", "--default_override=0:build=--remote_header=Authorization=" + Marker},
		{"--default_override=0:build=--action_env=A=B", "--default_override=0:build=--action_env=A=" + Marker},
		{"--define=K=" + awsKey, "--define=K=" + Marker},
		{"--project_id=alpha-0123456789abcdef", "--project_id=" + Marker}, // Bazel 4 sends the edge's API key here
		{"--keep_going", "--keep_going"},
		{"--override_repository=x=/tmp/x", "--override_repository=x=/tmp/x"},
		{"//pkg:target", "//pkg:target"},
		{"user@example.com", "user@example.com"},
		{"", ""},
	} {
		if got := r.Arg(c.in); got != c.want {
			t.Errorf("Arg(%q) = %q, want %q", c.in, got, c.want)
		}
		if got := r.Arg(r.Arg(c.in)); got != r.Arg(c.in) {
			t.Errorf("Arg twice (%q) = %q, not %q", c.in, got, r.Arg(c.in))
		}
	}
}

func TestArgTwoWords(t *testing.T) {
	r := MustNew(Config{})
	var st argState
	in := []string{"--remote_header", "Authorization=Bearer SECRET1", "--action_env", "T=SECRET2", "--action_env", "NAME", "--project_id", "KEY", "--keep_going", "//..."}
	want := []string{"--remote_header", "Authorization=" + Marker, "--action_env", "T=" + Marker, "--action_env", "NAME", "--project_id", Marker, "--keep_going", "//..."}
	for i, a := range in {
		if got := r.arg(a, &st); got != want[i] {
			t.Errorf("arg %d %q = %q, want %q", i, a, got, want[i])
		}
	}
}

func TestText(t *testing.T) {
	r := MustNew(Config{Patterns: []string{`corp-[0-9a-f]{8}`, `[0-9]{3}-[0-9]{2}-[0-9]{4}`}})
	for _, c := range []struct{ in, want string }{
		{"token " + ghToken + " here", "token " + Marker + " here"},
		{ghPAT, Marker},
		{"gho_Ab12Cd34Ef56Gh78Ij90Kl12", Marker},
		{"ghs_Ab12Cd34Ef56Gh78Ij90Kl12", Marker},
		{glToken, Marker},
		{"runner glrt-Ab12Cd34Ef56Gh78Ij90Kl, deploy gldt-Ab12Cd34Ef56Gh78Ij90Kl", "runner " + Marker + ", deploy " + Marker},
		{"-----BEGIN PGP PRIVATE KEY BLOCK-----\nlQOYBF\n-----END PGP PRIVATE KEY BLOCK-----",
			"-----BEGIN PGP PRIVATE KEY BLOCK-----" + Marker + "-----END PGP PRIVATE KEY BLOCK-----"},
		{"slack=" + slackToken, "slack=" + Marker},
		{"xoxp-1234567890-abcdefghijkl", Marker},
		{awsKey + "," + awsTempKey, Marker + "," + Marker},
		{"key=" + googleKey, "key=" + Marker},
		{"Authorization: Bearer " + jwt, "Authorization: Bearer " + Marker},
		{"a\n" + pemKey + "\nb", "a\n" + pemRedacted + "\nb"},
		{"-----BEGIN PRIVATE KEY-----\nMIIE", "-----BEGIN PRIVATE KEY-----" + Marker},
		{"-----BEGIN CERTIFICATE-----\nMIIE\n-----END CERTIFICATE-----", "-----BEGIN CERTIFICATE-----\nMIIE\n-----END CERTIFICATE-----"},
		{"fetching https://user:pw@example.com/x.tar.gz", "fetching https://" + Marker + "@example.com/x.tar.gz"},
		{"INFO: 'build' options: --remote_header=Authorization=Bearer SECRET1 --keep_going", "INFO: 'build' options: --remote_header=Authorization=" + Marker + " --keep_going"},
		{"opts --action_env='T=a b' --x", "opts --action_env='T=" + Marker + "' --x"},
		{"id corp-0123abcd and 123-45-6789", "id " + Marker + " and " + Marker},
		{"mail me at user@example.com", "mail me at user@example.com"},
		{"INFO: Build completed successfully, 42 total actions", "INFO: Build completed successfully, 42 total actions"},
		{"eyJ alone, AKIA short, ghp_short", "eyJ alone, AKIA short, ghp_short"},
	} {
		got := r.Text(c.in)
		if got != c.want {
			t.Errorf("Text(%q) =\n  %q, want\n  %q", c.in, got, c.want)
		}
		if again := r.Text(got); again != got {
			t.Errorf("Text twice (%q) = %q, not %q", c.in, again, got)
		}
	}
}

func TestNewRefusesBadPatterns(t *testing.T) {
	for _, p := range []string{`(`, `a*`, `redacted`, `<`} {
		if _, err := New(Config{Patterns: []string{p}}); err == nil {
			t.Errorf("New accepted pattern %q", p)
		}
	}
}

func TestShellArgs(t *testing.T) {
	r := MustNew(Config{Allow: DefaultAllow})
	in := `--host_javabase=@local_jdk//:jdk --keep_going --remote_header='Authorization=Bearer SECRET1' --test_env='MILLRACE_FLAKY_DIR=/tmp/x' --action_env=TOKEN=SECRET2 --build_metadata="K=SECRET3" --remote_header 'X=Y'`
	want := `--host_javabase=@local_jdk//:jdk --keep_going '--remote_header=Authorization=<redacted>' '--test_env=MILLRACE_FLAKY_DIR=<redacted>' '--action_env=TOKEN=<redacted>' '--build_metadata=K=<redacted>' --remote_header 'X=<redacted>'`
	got := r.ShellArgs(in)
	if got != want {
		t.Fatalf("ShellArgs =\n  %s\nwant\n  %s", got, want)
	}
	if again := r.ShellArgs(got); again != got {
		t.Fatalf("ShellArgs twice =\n  %s\nnot\n  %s", again, got)
	}
}

// Encoding helpers for the parts of a BuildEvent the bep package does not
// model (command_line.CommandLine, InvocationPolicy).

func str(num protowire.Number, s string) []byte {
	return protowire.AppendBytes(protowire.AppendTag(nil, num, protowire.BytesType), []byte(s))
}

func msgField(num protowire.Number, parts ...[]byte) []byte {
	return protowire.AppendBytes(protowire.AppendTag(nil, num, protowire.BytesType), bytes.Join(parts, nil))
}

func varint(num protowire.Number, v uint64) []byte {
	return protowire.AppendVarint(protowire.AppendTag(nil, num, protowire.VarintType), v)
}

// option encodes a command_line.Option.
func option(combined, name, value string) []byte {
	return msgField(1, str(1, combined), str(2, name), str(3, value), varint(4, 3), varint(5, 1))
}

// secretEvents are BuildEvents that carry every kind of secret the edge
// must remove, in the fields Bazel puts them in, and the secrets.
func secretEvents(t testing.TB) ([][]byte, []string) {
	secrets := []string{"SECRET1", "SECRET2", "SECRET3", "SECRET4", "SECRET5", "SECRET6", "SECRET7", ghToken, awsKey, jwt, "MIIEowIBAAKCAQEA0Z3VS5JJcds3xfn"}
	marshal := func(e *bep.BuildEvent) []byte {
		b, err := proto.Marshal(e)
		if err != nil {
			t.Fatal(err)
		}
		return b
	}
	args := []string{"test", "--client_env=PATH=/bin", "--client_env=GH_TOKEN=" + ghToken,
		"--remote_header=Authorization=Bearer SECRET1", "--action_env=TOKEN=SECRET2",
		"--test_env=T=SECRET5", "--repo_env=R=SECRET6", "--host_action_env=H=SECRET7",
		"--build_metadata=K=SECRET3", "--build_metadata=URL=https://u:SECRET4@host",
		"--remote_header", "X-Key=SECRET1", "--", "//..."}
	unstructured := marshal(&bep.BuildEvent{
		Id:      &bep.BuildEventId{Id: &bep.BuildEventId_UnstructuredCommandLine{UnstructuredCommandLine: &bep.BuildEventId_UnstructuredCommandLineId{}}},
		Payload: &bep.BuildEvent_UnstructuredCommandLine{UnstructuredCommandLine: &bep.UnstructuredCommandLine{Args: args}},
	})
	parsed := marshal(&bep.BuildEvent{
		Payload: &bep.BuildEvent_OptionsParsed{OptionsParsed: &bep.OptionsParsed{CmdLine: args[1:], ExplicitCmdLine: args[3:]}},
	})
	// InvocationPolicy (5) with a FlagPolicy setting --remote_header.
	parsed = append(parsed, msgField(13, msgField(5, msgField(1, str(1, "remote_header"), msgField(3, str(1, "Authorization=SECRET1")))))...)
	started := marshal(&bep.BuildEvent{Payload: &bep.BuildEvent_Started{Started: &bep.BuildStarted{
		Uuid: "u", Command: "test",
		OptionsDescription: `--remote_header='Authorization=Bearer SECRET1' --action_env=TOKEN=SECRET2 --build_metadata=K=SECRET3`,
	}}})
	metadata := marshal(&bep.BuildEvent{Payload: &bep.BuildEvent_BuildMetadata{BuildMetadata: &bep.BuildMetadata{
		Metadata: map[string]string{"K": "SECRET3", "URL": "https://u:SECRET4@host", "ROLE": "CI"},
	}}})
	status := marshal(&bep.BuildEvent{Payload: &bep.BuildEvent_WorkspaceStatus{WorkspaceStatus: &bep.WorkspaceStatus{Item: []*bep.WorkspaceStatus_Item{
		{Key: "BUILD_USER", Value: "root"}, {Key: "STABLE_DEPLOY_TOKEN", Value: "SECRET5"}, {Key: "GIT_REMOTE", Value: "https://x:SECRET6@git.example/r"},
	}}}})
	sections := msgField(22,
		str(1, "original"),
		msgField(2, str(1, "executable"), msgField(2, str(1, "bazel"))),
		msgField(2, str(1, "residual"), msgField(2, str(1, "--remote_header"), str(1, "Authorization=Bearer SECRET1"), str(1, "--action_env=TOKEN=SECRET2"))),
		msgField(2, str(1, "command options"), msgField(3,
			option("--remote_header=Authorization=Bearer SECRET1", "remote_header", "Authorization=Bearer SECRET1"),
			option("--action_env=TOKEN=SECRET2", "action_env", "TOKEN=SECRET2"),
			option("--test_env=T=SECRET5", "test_env", "T=SECRET5"),
			option("--repo_env=R=SECRET6", "repo_env", "R=SECRET6"),
			option("--build_metadata=K=SECRET3", "build_metadata", "K=SECRET3"),
			option("--remote_cache=https://u:SECRET4@cache", "remote_cache", "https://u:SECRET4@cache"),
			option("--keep_going", "keep_going", "1"),
		)),
	)
	// An unknown field (999) of each kind, which must survive.
	structured := append([]byte(nil), sections...)
	structured = append(structured, varint(999, 7)...)
	structured = append(structured, str(998, "unknown "+ghToken[:4])...)
	progress := marshal(&bep.BuildEvent{Payload: &bep.BuildEvent_Progress{Progress: &bep.Progress{
		Stderr: "INFO: Options provided by the client:\n  'build' options: --remote_header=Authorization=Bearer SECRET1\n" +
			"export GH=" + ghToken + " AWS=" + awsKey + "\nAuthorization: " + jwt + "\n" + pemKey + "\n",
	}}})
	// A failed action whose stderr came inline and whose stdout is a URL
	// with credentials (the builds projection stores both).
	action := marshal(&bep.BuildEvent{Payload: &bep.BuildEvent_Action{Action: &bep.ActionExecuted{
		ExitCode: 1, Type: "Genrule",
		Stderr: &bep.File{Name: "stderr", File: &bep.File_Contents{Contents: []byte("curl -H 'Authorization: token " + ghToken + "'\n")}},
		Stdout: &bep.File{Name: "stdout", File: &bep.File_Uri{Uri: "https://u:SECRET4@logs.example/1"}},
	}}})
	return [][]byte{unstructured, parsed, started, metadata, status, structured, progress, action}, secrets
}

// TestDefaultAllowKeepsCIMetadata: the --build_metadata keys CI systems set
// to say which commit, branch and run a build is keep their values by
// default (the builds projection finds builds by them); credentials in them
// still go, and every other key's value too.
func TestDefaultAllowKeepsCIMetadata(t *testing.T) {
	r := MustNew(Config{Allow: DefaultAllow})
	ev, err := proto.Marshal(&bep.BuildEvent{Payload: &bep.BuildEvent_BuildMetadata{BuildMetadata: &bep.BuildMetadata{
		Metadata: map[string]string{"COMMIT_SHA": "c0ffee", "BRANCH": "main", "ROLE": "CI",
			"CI_RUN_URL": "https://ci.example/run/7", "REPO_URL": "https://u:SECRET4@git.example/r", "DEPLOY_KEY": "SECRET3"},
	}}})
	if err != nil {
		t.Fatal(err)
	}
	out, _ := r.BuildEvent(ev)
	var be bep.BuildEvent
	if err := proto.Unmarshal(out, &be); err != nil {
		t.Fatal(err)
	}
	got := be.GetBuildMetadata().GetMetadata()
	for k, want := range map[string]string{"COMMIT_SHA": "c0ffee", "BRANCH": "main", "ROLE": "CI",
		"CI_RUN_URL": "https://ci.example/run/7", "REPO_URL": "https://" + Marker + "@git.example/r", "DEPLOY_KEY": Marker} {
		if got[k] != want {
			t.Errorf("%s: %q, want %q", k, got[k], want)
		}
	}
}

func TestBuildEventRemovesSecrets(t *testing.T) {
	r := MustNew(Config{Allow: append([]string{"ROLE"}, DefaultAllow...)})
	events, secrets := secretEvents(t)
	for i, ev := range events {
		out, changed := r.BuildEvent(ev)
		if !changed {
			t.Errorf("event %d: nothing redacted", i)
		}
		for _, s := range secrets {
			if bytes.Contains(out, []byte(s)) {
				t.Errorf("event %d: %q survived: %q", i, s, out)
			}
		}
		var be bep.BuildEvent
		if err := proto.Unmarshal(out, &be); err != nil {
			t.Errorf("event %d: output does not decode: %v", i, err)
		}
		if again, ch := r.BuildEvent(out); ch || !bytes.Equal(again, out) {
			t.Errorf("event %d: redacting twice changed it again", i)
		}
	}
	// What must stay: flag names, variable names, the allowed value,
	// plain values, unknown fields.
	all := func() string {
		var b strings.Builder
		for _, ev := range events {
			out, _ := r.BuildEvent(ev)
			b.Write(out)
		}
		return b.String()
	}()
	for _, keep := range []string{"--remote_header", "--action_env=TOKEN=", "--test_env=T=", "--repo_env=R=", "--host_action_env=H=",
		"--build_metadata=K=", "remote_header", "Authorization=" + Marker, "--client_env=PATH=/bin", "--client_env=GH_TOKEN=" + Marker,
		"STABLE_DEPLOY_TOKEN", "root", "ROLE", "CI", "--keep_going", "//...", "unknown ghp_", "https://" + Marker + "@cache"} {
		if !strings.Contains(all, keep) {
			t.Errorf("%q is gone from the redacted events", keep)
		}
	}
	if !bytes.Contains([]byte(all), varint(999, 7)) {
		t.Error("the unknown varint field is gone")
	}
}

func TestBuildEventUnchangedIsNotCopied(t *testing.T) {
	r := MustNew(Config{})
	b, _ := proto.Marshal(&bep.BuildEvent{Payload: &bep.BuildEvent_Progress{Progress: &bep.Progress{Stdout: "hello", Stderr: "INFO: Build completed successfully"}}})
	out, changed := r.BuildEvent(b)
	if changed || &out[0] != &b[0] {
		t.Fatal("an event with no secret was copied")
	}
	if n := testing.AllocsPerRun(100, func() { r.BuildEvent(b) }); n != 0 {
		t.Fatalf("%v allocations per clean event", n)
	}
	for _, bad := range [][]byte{{0xff}, {0x1a, 0x05, 0x0a}, {0x2a, 0x02, 0x22, 0x09}} {
		if out, changed := r.BuildEvent(bad); changed || !bytes.Equal(out, bad) {
			t.Errorf("malformed %x came back changed", bad)
		}
	}
}

// bazel run announces the command it will exec, with the client's
// environment: values go unless their names are allowed, argv is a command
// line like any other.
func TestExecRequestRedacted(t *testing.T) {
	r := MustNew(Config{Allow: DefaultAllow})
	env := func(name, value string) []byte { return msgField(3, str(1, name), str(2, value)) }
	ev := msgField(29,
		str(1, "/home/ci/ws"),
		str(2, "bazel-bin/tool"), str(2, "--token="+ghToken), str(2, "--remote_header=Authorization=Bearer SECRET1"),
		env("GH_TOKEN", "SECRET2"), env("PATH", "/usr/bin:/bin"), env("AWS_KEY", awsKey),
		str(4, "UNSET_ME"))
	out, changed := r.BuildEvent(ev)
	if !changed {
		t.Fatal("nothing redacted")
	}
	for _, sec := range []string{ghToken, "SECRET1", "SECRET2", awsKey} {
		if bytes.Contains(out, []byte(sec)) {
			t.Errorf("%q survived: %q", sec, out)
		}
	}
	for _, keep := range []string{"/home/ci/ws", "bazel-bin/tool", "--token=", "--remote_header=Authorization=", "GH_TOKEN", "/usr/bin:/bin", "AWS_KEY", "UNSET_ME"} {
		if !bytes.Contains(out, []byte(keep)) {
			t.Errorf("%q is gone: %q", keep, out)
		}
	}
	var be bep.BuildEvent
	if err := proto.Unmarshal(out, &be); err != nil {
		t.Fatalf("output does not decode: %v", err)
	}
}

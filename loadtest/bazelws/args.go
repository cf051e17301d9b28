package bazelws

import (
	"context"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
)

// RunOptions say how to run Bazel on a workspace made by Generate.
type RunOptions struct {
	// Dir is the directory given to Generate. Required.
	Dir string
	// Command is "test" (the default) or "build".
	Command string
	// Patterns are the target patterns; nil means //... .
	Patterns []string
	// OutputUserRoot is Bazel's --output_user_root; empty means Dir/output_user_root. Give every
	// concurrently running workspace its own, so that Bazel servers never share an output base.
	OutputUserRoot string
	// BESBackend is the BES address as host:port (no scheme); empty means no BES.
	BESBackend string
	// ProjectID is sent with every BES request (--project_id); empty means none.
	ProjectID string
	// InvocationID sets --invocation_id (a UUID), so a test knows the id before Bazel starts; empty lets
	// Bazel pick one.
	InvocationID string
	// JSONFile is where Bazel writes its own copy of the build events (--build_event_json_file); empty
	// means none.
	JSONFile string
	// FlakyDir is the state directory of flaky tests (see FlakyEnv); empty means Dir/flaky. Command
	// empties it before every run, because a leftover marker makes a flaky test pass on its first attempt.
	FlakyDir string
	// Extra flags go after all others, so they win.
	Extra []string
	// Env is the environment of the bazel process. Nil means MinimalEnv(Dir): Bazel copies its
	// client environment into the build events (--client_env), so inheriting the caller's would put
	// whatever it holds into recorded fixtures and make them depend on who recorded them.
	Env []string
}

// MinimalEnv is the environment Command gives Bazel unless told otherwise: the standard PATH (Bazel,
// bash and the JDK are system packages here), HOME set to dir so that nothing from a real home
// directory is read, and a fixed locale.
func MinimalEnv(dir string) []string {
	return []string{
		"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
		"HOME=" + dir,
		"LANG=C.UTF-8",
	}
}

// absolute makes every path absolute: Bazel runs in the workspace and would resolve relative paths
// against it, not against the caller's working directory.
func (o RunOptions) absolute() RunOptions {
	for _, p := range []*string{&o.Dir, &o.OutputUserRoot, &o.JSONFile, &o.FlakyDir} {
		if *p != "" {
			if abs, err := filepath.Abs(*p); err == nil {
				*p = abs
			}
		}
	}
	return o
}

func (o RunOptions) flakyDir() string {
	if o.FlakyDir != "" {
		return o.FlakyDir
	}
	return filepath.Join(o.Dir, flakySubdir)
}

// Args returns Bazel's arguments (without the program name) for running the workspace under opt.Dir:
// startup options, the command, its options, then the patterns.
//
// Why each flag:
//   - --batch: no Bazel server outlives the command, so tests leave no Java processes behind;
//   - --nohome_rc: a root user's ~/.bazelrc must not change fixtures; Debian's system rc
//     (/etc/bazel/bazelrc: the install base, the local JDK) stays in effect because it is needed offline;
//   - --nosandbox_debug: that rc turns sandbox debugging on, which keeps every sandbox on disk;
//   - --experimental_repository_disable_download and --override_repository: fail fast instead of hanging
//     on the network, and use the stand-in repositories Generate wrote;
//   - --keep_going: every target reports its outcome, failures included;
//   - --bes_timeout=60s: the default 0 waits forever for an unreachable backend;
//   - --bes_lifecycle_events: the lifecycle calls are part of what a BES server must accept;
//   - --build_event_publish_all_actions: action_completed for successful actions too, as CI builds send;
//   - --nocache_test_results and --flaky_test_attempts=2: tests really run, and flaky ones get their
//     second attempt.
func Args(opt RunOptions) []string {
	opt = opt.absolute()
	cmd := opt.Command
	if cmd == "" {
		cmd = "test"
	}
	root := opt.OutputUserRoot
	if root == "" {
		root = filepath.Join(opt.Dir, "output_user_root")
	}
	args := []string{
		"--batch",
		"--nohome_rc",
		"--output_user_root=" + root,
		cmd,
		"--keep_going",
		"--color=no",
		"--curses=no",
		"--nosandbox_debug",
		"--experimental_repository_disable_download",
	}
	for _, r := range StandInRepos {
		args = append(args, "--override_repository="+r+"="+filepath.Join(opt.Dir, reposSubdir, r))
	}
	if opt.BESBackend != "" {
		args = append(args,
			"--bes_backend=grpc://"+opt.BESBackend,
			"--bes_timeout=60s",
			"--bes_lifecycle_events",
		)
	}
	if opt.ProjectID != "" {
		args = append(args, "--project_id="+opt.ProjectID)
	}
	if opt.InvocationID != "" {
		args = append(args, "--invocation_id="+opt.InvocationID)
	}
	if opt.JSONFile != "" {
		args = append(args, "--build_event_json_file="+opt.JSONFile)
	}
	args = append(args, "--build_event_publish_all_actions")
	if cmd == "test" {
		args = append(args,
			"--nocache_test_results",
			"--flaky_test_attempts=2",
			"--test_env="+FlakyEnv+"="+opt.flakyDir(),
		)
	}
	args = append(args, opt.Extra...)
	patterns := opt.Patterns
	if len(patterns) == 0 {
		patterns = []string{"//..."}
	}
	args = append(args, "--")
	return append(args, patterns...)
}

// Command returns the bazel command for opt, to run in the workspace, after emptying the flaky state
// directory. Its output goes nowhere until the caller sets Stdout and Stderr.
//
// Bazel's exit code is meaningful (see Expected.ExitCode): a run that fails on purpose returns an
// *exec.ExitError from Run, so read cmd.ProcessState.ExitCode() rather than treating the error as fatal.
func Command(ctx context.Context, opt RunOptions) (*exec.Cmd, error) {
	if opt.Dir == "" {
		return nil, errors.New("bazelws: RunOptions.Dir is required")
	}
	opt = opt.absolute()
	fd := opt.flakyDir()
	if err := os.RemoveAll(fd); err != nil {
		return nil, err
	}
	if err := os.MkdirAll(fd, 0o755); err != nil {
		return nil, err
	}
	cmd := exec.CommandContext(ctx, "bazel", Args(opt)...)
	cmd.Dir = filepath.Join(opt.Dir, wsSubdir)
	cmd.Env = opt.Env
	if cmd.Env == nil {
		cmd.Env = MinimalEnv(opt.Dir)
	}
	return cmd, nil
}

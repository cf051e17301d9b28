package redact

// The fields of build_event_stream.BuildEvent (Bazel's
// src/main/java/com/google/devtools/build/lib/buildeventstream/proto/build_event_stream.proto,
// command_line.proto and invocation_policy.proto) that can carry a secret,
// by field number. Only length-delimited fields are listed; every field not
// listed is copied as it is. The numbers are Bazel's, like those of
// schemas/proto/build_event_stream.proto; the messages millrace's schema
// leaves out (CommandLine, InvocationPolicy) are described here.

// kind says what a length-delimited field holds and how it is redacted.
type kind uint8

const (
	kSkip      kind = iota
	kText           // free text: token shapes, URL credentials, flags written out
	kArg            // one argument of a command line; a flag without '=' makes the next one its value
	kShellArgs      // a command line as one string of shell words (BuildStarted.options_description)
	kMsg            // a message, described by sub
	kOption         // command_line.Option: option_value redacted by option_name
	kPolicy         // blaze.invocation_policy.FlagPolicy: its values redacted by flag_name
	kSecretKV       // a key (1) / value (2) pair whose value goes unless the key is allowed (build metadata)
	kStatusKV       // a workspace status item: the value goes if its key names a secret, else it is text
	kTextKV         // a key / value pair whose value is text (make variables)
)

type field struct {
	kind kind
	sub  *desc
}

// desc describes one message: fields by number (beyond len: not listed).
type desc struct {
	fields []field
}

func (d *desc) field(num int) field {
	if num < len(d.fields) {
		return d.fields[num]
	}
	return field{}
}

func msg(fields map[int]field) *desc {
	n := 0
	for k := range fields {
		n = max(n, k+1)
	}
	d := &desc{fields: make([]field, n)}
	for k, f := range fields {
		d.fields[k] = f
	}
	return d
}

func sub(d *desc) field { return field{kind: kMsg, sub: d} }

var (
	text = field{kind: kText}
	arg  = field{kind: kArg}

	failureDetail = msg(map[int]field{1: text})

	// File: uri (2) and inline contents (3), which the builds projection
	// stores for a failed action's stdout and stderr.
	file = msg(map[int]field{2: text, 3: text})

	// command_line.CommandLine: sections (2) of a chunk list (2) or an
	// option list (3).
	commandLine = msg(map[int]field{
		2: sub(msg(map[int]field{
			2: sub(msg(map[int]field{1: arg})),             // ChunkList.chunk
			3: sub(msg(map[int]field{1: {kind: kOption}})), // OptionList.option
		})),
	})

	// OptionsParsed: startup_options, explicit_startup_options, cmd_line,
	// explicit_cmd_line, invocation_policy (5) of flag_policies (1).
	optionsParsed = msg(map[int]field{
		1: arg, 2: arg, 3: arg, 4: arg,
		5: sub(msg(map[int]field{1: {kind: kPolicy}})),
	})

	buildEventID = msg(map[int]field{
		17: sub(msg(map[int]field{1: text})), // FetchId.url
	})

	buildEvent = msg(map[int]field{
		1:  sub(buildEventID),
		2:  sub(buildEventID),                                                                    // children
		3:  sub(msg(map[int]field{1: text, 2: text})),                                            // Progress stdout, stderr
		4:  sub(msg(map[int]field{2: text})),                                                     // Aborted.description
		5:  sub(msg(map[int]field{4: {kind: kShellArgs}})),                                       // BuildStarted.options_description
		7:  sub(msg(map[int]field{3: sub(file), 4: sub(file), 9: text, 11: sub(failureDetail)})), // ActionExecuted stdout, stderr, command_line, failure_detail
		8:  sub(msg(map[int]field{9: sub(failureDetail)})),                                       // TargetComplete.failure_detail
		10: sub(msg(map[int]field{7: text, 9: text})),                                            // TestResult warning, status_details
		12: sub(msg(map[int]field{1: arg})),                                                      // UnstructuredCommandLine.args
		13: sub(optionsParsed),                                                                   //
		14: sub(msg(map[int]field{6: sub(failureDetail)})),                                       // BuildFinished.failure_detail
		16: sub(msg(map[int]field{1: {kind: kStatusKV}})),                                        // WorkspaceStatus.item
		17: sub(msg(map[int]field{4: {kind: kTextKV}})),                                          // Configuration.make_variable
		22: sub(commandLine),                                                                     // structured_command_line
		26: sub(msg(map[int]field{1: {kind: kSecretKV}})),                                        // BuildMetadata.metadata
		// ExecRequestConstructed (bazel run): working_directory, argv, and
		// environment_variable, name (1) / value (2) pairs of the client's
		// environment, whose values go unless the name is allowed.
		29: sub(msg(map[int]field{1: text, 2: arg, 3: {kind: kSecretKV}})),
	})
)

// compose-validate loads Compose files the way `docker compose` does, with the same library
// (github.com/compose-spec/compose-go/v2), and prints the normalised project as JSON.
//
//	compose-validate [-f FILE]... [-scale SERVICE=N]...
//
// Loading validates the files against the Compose Specification's JSON schema, interpolates
// ${VAR} from this process's environment (a .env file is deliberately NOT read, so the result
// depends only on the files and the environment), normalises (port strings become
// {host_ip, target, published}, durations are parsed, paths are resolved) and checks consistency
// (undefined volumes or networks, dependency cycles, container_name with scale > 1, ...).
//
// -scale SERVICE=N is what `docker compose up --scale SERVICE=N` asks for: it is applied as an
// override file setting `scale: N`, so the loader's own consistency checks see it. On top of the
// loader, a service with more than one replica must not publish a fixed host port (the engine
// would refuse the second replica: "port is already allocated").
//
// Exit status: 0 and the project on stdout; 1 and the loader's error on stderr; 2 on bad usage.
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"github.com/compose-spec/compose-go/v2/cli"
	"github.com/compose-spec/compose-go/v2/types"
)

type listFlag []string

func (l *listFlag) String() string     { return strings.Join(*l, ",") }
func (l *listFlag) Set(v string) error { *l = append(*l, v); return nil }

func main() {
	var files, scales listFlag
	flag.Var(&files, "f", "Compose file (repeatable; later files override earlier ones; default docker-compose.yml)")
	flag.Var(&scales, "scale", "SERVICE=N, as `docker compose up --scale` (repeatable)")
	flag.Parse()
	if flag.NArg() != 0 {
		fmt.Fprintf(os.Stderr, "compose-validate: unexpected arguments %q\n", flag.Args())
		os.Exit(2)
	}
	if len(files) == 0 {
		files = listFlag{"docker-compose.yml"}
	}
	override, err := scaleOverride(scales)
	if err != nil {
		fmt.Fprintf(os.Stderr, "compose-validate: %v\n", err)
		os.Exit(2)
	}
	out, err := load(files, override)
	if err != nil {
		fmt.Fprintf(os.Stderr, "compose-validate: %v\n", err)
		os.Exit(1)
	}
	os.Stdout.Write(append(out, '\n'))
}

// scaleOverride turns SERVICE=N pairs into the text of a Compose override file ("" for none).
func scaleOverride(scales []string) (string, error) {
	if len(scales) == 0 {
		return "", nil
	}
	var b strings.Builder
	b.WriteString("services:\n")
	for _, s := range scales {
		name, n, ok := strings.Cut(s, "=")
		replicas, err := strconv.Atoi(n)
		if !ok || name == "" || err != nil || replicas < 0 {
			return "", fmt.Errorf("-scale wants SERVICE=N with N >= 0, got %q", s)
		}
		fmt.Fprintf(&b, "  %s:\n    scale: %d\n", strconv.Quote(name), replicas)
	}
	return b.String(), nil
}

func load(files []string, override string) ([]byte, error) {
	paths := make([]string, 0, len(files)+1)
	for _, f := range files {
		abs, err := filepath.Abs(f)
		if err != nil {
			return nil, err
		}
		paths = append(paths, abs)
	}
	if override != "" {
		tmp, err := os.CreateTemp("", "compose-validate-scale-*.yml")
		if err != nil {
			return nil, err
		}
		defer os.Remove(tmp.Name())
		if _, err := tmp.WriteString(override); err != nil {
			return nil, err
		}
		if err := tmp.Close(); err != nil {
			return nil, err
		}
		paths = append(paths, tmp.Name())
	}

	// The project directory is the first file's, as for `docker compose -f FILE`.
	opts, err := cli.NewProjectOptions(paths,
		cli.WithWorkingDirectory(filepath.Dir(paths[0])),
		cli.WithOsEnv,
		cli.WithInterpolation(true),
		cli.WithNormalization(true),
		cli.WithResolvedPaths(true),
		cli.WithConsistency(true),
	)
	if err != nil {
		return nil, err
	}
	project, err := opts.LoadProject(context.Background())
	if err != nil {
		return nil, err
	}
	if project, err = project.WithServicesEnvironmentResolved(true); err != nil {
		return nil, err
	}
	if err := project.CheckContainerNameUnicity(); err != nil {
		return nil, err
	}
	if err := checkScaledPorts(project); err != nil {
		return nil, err
	}
	return project.MarshalJSON()
}

// checkScaledPorts refuses a fixed host port on a service with more than one replica.
func checkScaledPorts(project *types.Project) error {
	for name, s := range project.Services {
		if s.GetScale() <= 1 {
			continue
		}
		for _, p := range s.Ports {
			if p.Published != "" && !strings.Contains(p.Published, "-") {
				return fmt.Errorf("services.%s: scale %d with the fixed host port %s: replicas would collide",
					name, s.GetScale(), p.Published)
			}
		}
	}
	return nil
}

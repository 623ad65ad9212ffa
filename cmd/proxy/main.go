// Command stopgate is the stopgate binary: `stopgate serve` and the CLI on
// its control API. It is wiring only: the command line is package cli,
// the server package serve (which cli runs for `stopgate serve`), the
// agent supervisor package agentexec. The first process of exec's sandbox
// and the browsers' sandbox helper are this binary too, and start here.
package main

import (
	"context"
	"os"
	"os/signal"
	"syscall"

	"github.com/stopgate/stopgate/agentexec"
	"github.com/stopgate/stopgate/browserguard"
	"github.com/stopgate/stopgate/cli"
)

func main() {
	if len(os.Args) > 1 && os.Args[1] == agentexec.InitVerb {
		os.Exit(agentexec.Init(os.Args[2:]))
	}
	browserguard.SandboxMain()
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	code := cli.Run(ctx, os.Args[1:], cli.Env{Stdin: os.Stdin, Stdout: os.Stdout, Stderr: os.Stderr, Getenv: os.Getenv})
	stop()
	os.Exit(code)
}

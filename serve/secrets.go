package serve

import (
	"context"
	"fmt"
	"log/slog"
	"path/filepath"
	"strings"

	"github.com/stopgate/stopgate/control"
	"github.com/stopgate/stopgate/runtoken"
)

// controlSecrets are the control plane's credentials as serve uses them:
// the operator's and the reader's bearer tokens, and the signer of run
// tokens (the workers' credentials, for the proxy and the control API).
type controlSecrets struct {
	operator, read string
	open           bool
	signer         *runtoken.Signer
}

// loadControlSecrets takes the secrets serve was given, and reads (or, on
// the first start, creates) the others in the data directory, so that a
// fresh stopgate is closed and yet its CLI works from the same directory.
// It logs where each comes from, and warns about secrets that others can
// read: on the command line, or in a file open to other users.
func loadControlSecrets(cfg Config, log *slog.Logger) (controlSecrets, error) {
	var s controlSecrets
	for _, flag := range strings.Split(cfg.SecretsOnCommandLine, ",") {
		instead := flag + "-file or the environment"
		if flag == "--store" {
			instead = "--store-password-file or " + storePasswordEnv + " for the password (and STOPGATE_STORE for the URL)"
		}
		if flag != "" {
			log.Warn("a secret is on the command line, where every user of this machine can read it (ps, /proc/PID/cmdline): use "+instead,
				"flag", flag)
		}
	}
	inDataDir := func(name, file string, generate func() (string, error)) (string, error) {
		path := filepath.Join(cfg.DataDir, file)
		secret, created, exposed, err := control.LoadOrCreateSecret(path, generate)
		if err != nil {
			return "", fmt.Errorf("--data-dir %s: the %s: %w", cfg.DataDir, name, err)
		}
		if created {
			log.Info("created the "+name, "file", path, "mode", "0600")
		} else {
			log.Info("read the "+name, "file", path)
		}
		if exposed {
			log.Warn("the "+name+" file is readable by other users: chmod 600 it", "file", path)
		}
		return secret, nil
	}

	secret, err := cfg.RunTokenSecret, error(nil)
	if secret == "" {
		if secret, err = inDataDir("run-token secret", control.RunTokenSecretFile, control.GenerateSecret); err != nil {
			return s, err
		}
	}
	if s.signer, err = runtoken.New([]byte(secret)); err != nil {
		return s, configErrorf("run-token secret: %v", err)
	}

	if cfg.ControlAuth == authNone {
		s.open = true
		return s, nil
	}
	s.operator = cfg.ControlToken
	if s.operator == "" {
		if s.operator, err = inDataDir("operator token", control.OperatorTokenFile, func() (string, error) {
			return control.GenerateToken(control.OperatorTokenPrefix)
		}); err != nil {
			return s, err
		}
	}
	if cfg.ReadTokenFile != "" {
		s.read, _, err = control.ReadSecretFile(cfg.ReadTokenFile)
		if err != nil {
			return s, configErrorf("--read-token-file: %v", err)
		}
	} else if s.read, err = inDataDir("read-only token", control.ReadTokenFile, func() (string, error) {
		return control.GenerateToken(control.ReadTokenPrefix)
	}); err != nil {
		return s, err
	}
	if s.read == s.operator {
		return s, configErrorf("the read-only token is the operator token; give them different values")
	}
	return s, nil
}

// warnOpen says, as loudly as a log can, that the control plane is open.
// Beyond loopback it is an error-level line: the whole network may reach it.
func warnOpen(log *slog.Logger, addr string, loopback bool) {
	level := slog.LevelWarn
	if !loopback {
		level = slog.LevelError
	}
	log.Log(context.Background(), level, "THE CONTROL API IS OPEN (--control-auth=none): anyone who reaches "+addr+
		" can cancel, complete and admit runs, resolve UNKNOWN effects as they like and mint run tokens; "+
		"an agent behind the proxy must never reach it", "addr", addr)
}

package redisstore

import (
	"context"
	"crypto/sha1"
	_ "embed"
	"encoding/hex"
	"errors"
	"fmt"
	"strings"
	"sync"

	"github.com/redis/go-redis/v9"
)

// The Lua sources. Each per-run operation is one program, run atomically by
// Redis; the prelude holds the rules several of them share and the steps
// the two operations on every effect's path, so those rules are written
// once.
var (
	//go:embed lua/prelude.lua
	preludeLua string
	//go:embed lua/steps.lua
	stepsLua string
	//go:embed lua/batch.lua
	batchLua string
	//go:embed lua/admit.lua
	admitLua string
	//go:embed lua/cancel.lua
	cancelLua string
	//go:embed lua/complete.lua
	completeLua string
	//go:embed lua/resolve.lua
	resolveLua string
	//go:embed lua/tick.lua
	tickLua string
	//go:embed lua/renew.lua
	renewLua string
	//go:embed lua/note.lua
	noteLua string
	//go:embed lua/prune.lua
	pruneLua string
	//go:embed lua/index.lua
	indexLua string
	//go:embed lua/unindex.lua
	unindexLua string
	//go:embed lua/layout.lua
	layoutLua string
)

// A program is one per-run operation. Redis runs it as a function of
// stopgate's library (FCALL): the prelude's helpers are defined once, when
// the library loads, instead of on every call as a script's are. Where
// Redis has no functions (before 7.0) or refuses to load them (an ACL
// without FUNCTION), the same code runs as a script: EVALSHA, and the full
// source on NOSCRIPT.
//
// A program's lib is code of its own that the library runs once, when it
// loads, as it runs the prelude: tables a call refills rather than makes
// afresh (batch.lua). As a script, it runs on every call.
type program struct {
	name   string
	lib    string
	body   string
	script *redis.Script
}

func newProgram(name, lib, body string) *program {
	return &program{name: name, lib: lib, body: body,
		script: redis.NewScript(preludeLua + "\n" + stepsLua + "\n" + lib + "\nbegin(KEYS, ARGV)\n" + body)}
}

var (
	batchProgram    = newProgram("batch", batchLua, "return batch(KEYS)")
	admitProgram    = newProgram("admit", "", admitLua)
	cancelProgram   = newProgram("cancel", "", cancelLua)
	completeProgram = newProgram("complete", "", completeLua)
	resolveProgram  = newProgram("resolve", "", resolveLua)
	tickProgram     = newProgram("tick", "", tickLua)
	renewProgram    = newProgram("renew", "", renewLua)
	noteProgram     = newProgram("note", "", noteLua)
	pruneProgram    = newProgram("prune", "", pruneLua)
	programs        = []*program{batchProgram, admitProgram, cancelProgram, completeProgram,
		resolveProgram, tickProgram, renewProgram, noteProgram, pruneProgram}

	// The index scripts touch the cross-run indexes, not a run: scripts
	// without the prelude.
	indexScript   = redis.NewScript(indexLua)
	unindexScript = redis.NewScript(unindexLua)
	layoutScript  = redis.NewScript(layoutLua)
)

// library is the function library: its name carries a digest of its code,
// so that instances of different stopgate versions sharing one Redis each
// call their own functions and never replace each other's.
var library = buildLibrary()

type lib struct {
	name string // library name, also the prefix of every function
	code string
}

func buildLibrary() lib {
	var b strings.Builder
	b.WriteString(preludeLua + "\n" + stepsLua + "\n")
	for _, p := range programs {
		b.WriteString(p.lib + "\n")
	}
	for _, p := range programs {
		fmt.Fprintf(&b, "redis.register_function('%%s_%s', function(KEYS, ARGV)\nbegin(KEYS, ARGV)\n%s\nend)\n", p.name, p.body)
	}
	sum := sha1.Sum([]byte(b.String()))
	name := "stopgate_" + hex.EncodeToString(sum[:6])
	return lib{name: name, code: "#!lua name=" + name + "\n" + strings.ReplaceAll(b.String(), "'%s_", "'"+name+"_")}
}

func (l lib) function(p *program) string { return l.name + "_" + p.name }

// functions says how this store runs its programs: as functions once the
// library is loaded, as scripts when Redis refused it.
type functions struct {
	mu      sync.Mutex
	enabled bool
}

func (f *functions) on() bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.enabled
}

// loadLibrary loads the function library into every master. A Redis
// without functions, or a user not allowed FUNCTION, leaves the store on
// scripts; a Redis that cannot be reached is an error.
func (s *Store) loadLibrary(ctx context.Context) error {
	load := func(ctx context.Context, c redis.Cmdable) error {
		return c.FunctionLoadReplace(ctx, library.code).Err()
	}
	var err error
	if cc, ok := s.rdb.(*redis.ClusterClient); ok {
		err = cc.ForEachMaster(ctx, func(ctx context.Context, c *redis.Client) error { return load(ctx, c) })
	} else {
		err = load(ctx, s.rdb)
	}
	s.fns.mu.Lock()
	defer s.fns.mu.Unlock()
	switch {
	case err == nil:
		s.fns.enabled = true
		return nil
	case noFunctions(err):
		if s.fns.enabled {
			s.log.Warn("redis refused the function library; running stopgate's operations as scripts", "err", err)
		}
		s.fns.enabled = false
		return nil
	}
	return s.fail("function load", "", err)
}

// noFunctions reports whether err says this Redis cannot take functions
// (too old, FUNCTION renamed away, or not allowed to this user), rather
// than that it could not be reached.
func noFunctions(err error) bool {
	var rerr redis.Error
	if !errors.As(err, &rerr) || unavailable(err) {
		return false
	}
	msg := strings.ToLower(err.Error())
	return strings.Contains(msg, "unknown command") || strings.Contains(msg, "unknown subcommand") ||
		strings.HasPrefix(msg, "noperm") || strings.Contains(msg, "no permissions")
}

// functionMissing reports whether Redis answered that a function does not
// exist: the library was flushed (FUNCTION FLUSH, a restart without
// persistence, a node that joined later). The function did not run.
func functionMissing(err error) bool {
	return err != nil && strings.Contains(strings.ToLower(err.Error()), "function not found")
}

// exec runs one program on keys. A function found missing is loaded again
// and called once more: it had not run.
func (s *Store) exec(ctx context.Context, p *program, keys []string, args ...any) *redis.Cmd {
	if !s.fns.on() {
		return p.script.Run(ctx, s.scripter, keys, args...)
	}
	cmd := s.scripter.fcall(ctx, library.function(p), keys, args)
	if functionMissing(cmd.Err()) {
		if err := s.loadLibrary(ctx); err != nil {
			return cmd
		}
		if !s.fns.on() {
			return p.script.Run(ctx, s.scripter, keys, args...)
		}
		cmd = s.scripter.fcall(ctx, library.function(p), keys, args)
	}
	return cmd
}

// onceScripter runs EVAL, EVALSHA and FCALL as commands go-redis never
// sends twice.
//
// MaxRetries -1 stops the plain client from retrying, but the cluster client
// retries a command whose reply was lost (EOF, timeout) up to MaxRedirects
// times, on the same node: a program that already ran (a cancel, a guard
// that admitted an effect) would run again. A command that reports NoRetry
// is never re-sent once written, while MOVED and ASK (the program did not
// run) are still followed.
type onceScripter struct {
	rdb redis.UniversalClient
}

// onceCmd is a program call that must not be re-sent.
type onceCmd struct{ *redis.Cmd }

func (onceCmd) NoRetry() bool { return true }

func (s onceScripter) call(ctx context.Context, name, payload string, keys []string, args []any) *redis.Cmd {
	cmdArgs := make([]any, 0, 3+len(keys)+len(args))
	cmdArgs = append(cmdArgs, name, payload, len(keys))
	for _, k := range keys {
		cmdArgs = append(cmdArgs, k)
	}
	cmdArgs = append(cmdArgs, args...)
	cmd := redis.NewCmd(ctx, cmdArgs...)
	if len(keys) > 0 {
		// The cluster client routes by the first key.
		cmd.SetFirstKeyPos(3)
	}
	_ = s.rdb.Process(ctx, onceCmd{cmd})
	return cmd
}

func (s onceScripter) fcall(ctx context.Context, function string, keys []string, args []any) *redis.Cmd {
	return s.call(ctx, "fcall", function, keys, args)
}

func (s onceScripter) Eval(ctx context.Context, script string, keys []string, args ...any) *redis.Cmd {
	return s.call(ctx, "eval", script, keys, args)
}

func (s onceScripter) EvalSha(ctx context.Context, sha1 string, keys []string, args ...any) *redis.Cmd {
	return s.call(ctx, "evalsha", sha1, keys, args)
}

func (s onceScripter) EvalRO(ctx context.Context, script string, keys []string, args ...any) *redis.Cmd {
	return s.call(ctx, "eval_ro", script, keys, args)
}

func (s onceScripter) EvalShaRO(ctx context.Context, sha1 string, keys []string, args ...any) *redis.Cmd {
	return s.call(ctx, "evalsha_ro", sha1, keys, args)
}

func (s onceScripter) ScriptExists(ctx context.Context, hashes ...string) *redis.BoolSliceCmd {
	return s.rdb.ScriptExists(ctx, hashes...)
}

func (s onceScripter) ScriptLoad(ctx context.Context, script string) *redis.StringCmd {
	return s.rdb.ScriptLoad(ctx, script)
}

// execOn runs one program on conn, a connection of its own (a cancel that
// WAITs for replicas must run on the connection it waits on). Node clients
// never retry, so nothing here is sent twice; a function found missing is
// loaded again and called once more, as exec does.
func (s *Store) execOn(ctx context.Context, conn *redis.Conn, p *program, keys []string, args ...any) *redis.Cmd {
	if !s.fns.on() {
		return p.script.Run(ctx, conn, keys, args...)
	}
	cmd := conn.FCall(ctx, library.function(p), keys, args...)
	if functionMissing(cmd.Err()) {
		if err := s.loadLibrary(ctx); err != nil {
			return cmd
		}
		if !s.fns.on() {
			return p.script.Run(ctx, conn, keys, args...)
		}
		cmd = conn.FCall(ctx, library.function(p), keys, args...)
	}
	return cmd
}

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

// The Lua sources. Each program writes (apply, prune) or reads (read) one
// or more runs in one atomic step of the server; none of them decides
// anything: the rules are package machine's, in Go.
var (
	//go:embed lua/apply.lua
	applyLua string
	//go:embed lua/read.lua
	readLua string
	//go:embed lua/prune.lua
	pruneLua string
	//go:embed lua/index.lua
	indexLua string
	//go:embed lua/unindex.lua
	unindexLua string
	//go:embed lua/layout.lua
	layoutLua string
)

// A program is one function of stopgate's library: its source defines a
// local function of its name, taking KEYS and ARGV. Redis runs it as a
// function of the library (FCALL); where Redis has no functions (before
// 7.0) or refuses to load them (an ACL without FUNCTION), the same code
// runs as a script: EVALSHA, and the full source on NOSCRIPT.
type program struct {
	name   string
	code   string
	script *redis.Script
	// function is its name in the library (library.function).
	function string
}

func newProgram(name, code string) *program {
	code = rowPrelude() + code
	return &program{name: name, code: code, script: redis.NewScript(code + "\nreturn " + name + "(KEYS, ARGV)\n")}
}

// rowPrelude names the row's own fields for the programs (ROW), from
// rowFields: the programs read them without being sent their names.
func rowPrelude() string {
	quoted := make([]string, len(rowFields))
	for i, f := range rowFields {
		quoted[i] = "'" + f + "'"
	}
	return "local ROW = {" + strings.Join(quoted, ", ") + "}\n"
}

var (
	applyProgram = newProgram("apply", applyLua)
	readProgram  = newProgram("read", readLua)
	pruneProgram = newProgram("prune", pruneLua)
	programs     = []*program{applyProgram, readProgram, pruneProgram}

	// The index scripts touch the cross-run indexes, not a run.
	indexScript   = redis.NewScript(indexLua)
	unindexScript = redis.NewScript(unindexLua)
	layoutScript  = redis.NewScript(layoutLua)
)

// library is the function library: its name carries a digest of its code,
// so that instances of different stopgate versions sharing one Redis each
// call their own functions and never replace each other's.
var library = buildLibrary()

func init() {
	for _, p := range programs {
		p.function = library.function(p)
	}
}

type lib struct {
	name string // library name, also the prefix of every function
	code string
}

func buildLibrary() lib {
	var b strings.Builder
	for _, p := range programs {
		b.WriteString(p.code + "\n")
	}
	for _, p := range programs {
		fmt.Fprintf(&b, "redis.register_function('%%s_%s', %s)\n", p.name, p.name)
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

// Functions reports whether the store runs its programs as functions of
// its library (true) or as scripts, where Redis refused the library.
func (s *Store) Functions() bool { return s.fns.on() }

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

// execBuilt is exec for arguments built after room for the command's
// head (headRoom), which it fills: the arguments are not copied again.
func (s *Store) execBuilt(ctx context.Context, p *program, keys []string, cmd []any) *redis.Cmd {
	head := headRoom(keys)
	if !s.fns.on() {
		return s.exec(ctx, p, keys, cmd[head:]...)
	}
	cmd[0], cmd[1], cmd[2] = "fcall", p.function, len(keys)
	for i, k := range keys {
		cmd[3+i] = k
	}
	c := redis.NewCmd(ctx, cmd...)
	if len(keys) > 0 {
		// The cluster client routes by the first key.
		c.SetFirstKeyPos(3)
	}
	_ = s.rdb.Process(ctx, onceCmd{c})
	if functionMissing(c.Err()) {
		return s.exec(ctx, p, keys, cmd[head:]...)
	}
	return c
}

// exec runs one program on keys. A function found missing is loaded again
// and called once more: it had not run.
func (s *Store) exec(ctx context.Context, p *program, keys []string, args ...any) *redis.Cmd {
	if !s.fns.on() {
		return p.script.Run(ctx, s.scripter, keys, args...)
	}
	cmd := s.scripter.fcall(ctx, p.function, keys, args)
	if functionMissing(cmd.Err()) {
		if err := s.loadLibrary(ctx); err != nil {
			return cmd
		}
		if !s.fns.on() {
			return p.script.Run(ctx, s.scripter, keys, args...)
		}
		cmd = s.scripter.fcall(ctx, p.function, keys, args)
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

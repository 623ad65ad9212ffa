package redisstore

import (
	"context"
	_ "embed"

	"github.com/redis/go-redis/v9"
)

// The Lua sources. Each per-run operation is one script, run atomically by
// Redis; the prelude holds the rules several of them share and is put in
// front of each at init, so those rules are written once.
var (
	//go:embed lua/prelude.lua
	preludeLua string
	//go:embed lua/admit.lua
	admitLua string
	//go:embed lua/cancel.lua
	cancelLua string
	//go:embed lua/complete.lua
	completeLua string
	//go:embed lua/guard.lua
	guardLua string
	//go:embed lua/finish.lua
	finishLua string
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

// The scripts as Redis runs them: EVALSHA first, the full source on NOSCRIPT
// (after a restart or SCRIPT FLUSH the server forgets loaded scripts).
var (
	admitScript    = runScript(admitLua)
	cancelScript   = runScript(cancelLua)
	completeScript = runScript(completeLua)
	guardScript    = runScript(guardLua)
	finishScript   = runScript(finishLua)
	resolveScript  = runScript(resolveLua)
	tickScript     = runScript(tickLua)
	renewScript    = runScript(renewLua)
	noteScript     = runScript(noteLua)
	pruneScript    = runScript(pruneLua)
	// The index scripts touch the cross-run indexes, not a run: no prelude.
	indexScript   = redis.NewScript(indexLua)
	unindexScript = redis.NewScript(unindexLua)
	layoutScript  = redis.NewScript(layoutLua)
)

func runScript(body string) *redis.Script {
	return redis.NewScript(preludeLua + "\n" + body)
}

// onceScripter runs EVAL and EVALSHA as commands go-redis never sends twice.
//
// MaxRetries -1 stops the plain client from retrying, but the cluster client
// retries a command whose reply was lost (EOF, timeout) up to MaxRedirects
// times, on the same node: a script that already ran (a cancel, a guard that
// admitted an effect) would run again. A command that reports NoRetry is
// never re-sent once written, while MOVED and ASK (the script did not run)
// are still followed.
type onceScripter struct {
	rdb redis.UniversalClient
}

// onceCmd is a script call that must not be re-sent.
type onceCmd struct{ *redis.Cmd }

func (onceCmd) NoRetry() bool { return true }

func (s onceScripter) eval(ctx context.Context, name, payload string, keys []string, args []any) *redis.Cmd {
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

func (s onceScripter) Eval(ctx context.Context, script string, keys []string, args ...any) *redis.Cmd {
	return s.eval(ctx, "eval", script, keys, args)
}

func (s onceScripter) EvalSha(ctx context.Context, sha1 string, keys []string, args ...any) *redis.Cmd {
	return s.eval(ctx, "evalsha", sha1, keys, args)
}

func (s onceScripter) EvalRO(ctx context.Context, script string, keys []string, args ...any) *redis.Cmd {
	return s.eval(ctx, "eval_ro", script, keys, args)
}

func (s onceScripter) EvalShaRO(ctx context.Context, sha1 string, keys []string, args ...any) *redis.Cmd {
	return s.eval(ctx, "evalsha_ro", sha1, keys, args)
}

func (s onceScripter) ScriptExists(ctx context.Context, hashes ...string) *redis.BoolSliceCmd {
	return s.rdb.ScriptExists(ctx, hashes...)
}

func (s onceScripter) ScriptLoad(ctx context.Context, script string) *redis.StringCmd {
	return s.rdb.ScriptLoad(ctx, script)
}

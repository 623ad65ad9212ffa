package bench

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
)

// The stored-volume phase spends minutes writing a million rows through the
// store's own code. Its result depends only on that code: a store loaded by
// the same code is the same store, so it is kept in Config.CacheDir and
// copied back next time. The key names the code: Config.CacheKey (make
// bench hashes the sources of the store packages, the ledger, the loader
// and the module's dependencies), or else this binary's own hash, which
// changes with any code compiled into it. Any change misses the cache and
// loads again; only the current key's entries are kept.

// cache holds loaded stores under CacheDir/<key>/<entry>/.
type cache struct {
	dir string // CacheDir/<key>; "" when caching is off
}

func openCache(root, key string) (*cache, error) {
	if root == "" {
		return &cache{}, nil
	}
	if key != "" {
		if strings.ContainsAny(key, `/\.`) || len(key) > 64 {
			return nil, fmt.Errorf("cache key %q: want up to 64 letters and digits", key)
		}
		return &cache{dir: filepath.Join(root, key)}, nil
	}
	exe, err := os.Executable()
	if err != nil {
		return nil, fmt.Errorf("cache: %w", err)
	}
	f, err := os.Open(exe)
	if err != nil {
		return nil, fmt.Errorf("cache: %w", err)
	}
	defer f.Close()
	h := sha256.New()
	if _, err := io.Copy(h, f); err != nil {
		return nil, fmt.Errorf("cache: hashing %s: %w", exe, err)
	}
	return &cache{dir: filepath.Join(root, hex.EncodeToString(h.Sum(nil))[:16])}, nil
}

// cachedEntry is what an entry remembers of the load that made it.
type cachedEntry struct {
	Loads []loadRecord `json:"loads"`
}

// restore copies entry's files into dst and returns its load records;
// ok is false on a miss.
func (c *cache) restore(entry, dst string) (loads []loadRecord, ok bool, err error) {
	if c.dir == "" {
		return nil, false, nil
	}
	src := filepath.Join(c.dir, entry)
	b, err := os.ReadFile(filepath.Join(src, "entry.json"))
	if errors.Is(err, fs.ErrNotExist) {
		return nil, false, nil
	}
	if err != nil {
		return nil, false, fmt.Errorf("cache: %w", err)
	}
	var e cachedEntry
	if err := json.Unmarshal(b, &e); err != nil {
		return nil, false, fmt.Errorf("cache entry %s: %w", src, err)
	}
	if err := copyTree(filepath.Join(src, "files"), dst); err != nil {
		return nil, false, fmt.Errorf("cache: restoring %s: %w", src, err)
	}
	return e.Loads, true, nil
}

// save copies the files under src into entry, then records loads; an
// entry without its record is not an entry. Entries of other binaries are
// removed first.
func (c *cache) save(entry, src string, loads []loadRecord) error {
	if c.dir == "" {
		return nil
	}
	root := filepath.Dir(c.dir)
	if olds, err := os.ReadDir(root); err == nil {
		for _, o := range olds {
			if p := filepath.Join(root, o.Name()); p != c.dir {
				_ = os.RemoveAll(p)
			}
		}
	}
	dst := filepath.Join(c.dir, entry)
	_ = os.RemoveAll(dst)
	if err := copyTree(src, filepath.Join(dst, "files")); err != nil {
		return fmt.Errorf("cache: saving %s: %w", entry, err)
	}
	b, err := json.Marshal(cachedEntry{Loads: loads})
	if err != nil {
		return err
	}
	return os.WriteFile(filepath.Join(dst, "entry.json"), b, 0o600)
}

// copyTree copies the regular files under src into dst, keeping their
// relative paths.
func copyTree(src, dst string) error {
	return filepath.WalkDir(src, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, err := filepath.Rel(src, path)
		if err != nil {
			return err
		}
		if d.IsDir() {
			return os.MkdirAll(filepath.Join(dst, rel), 0o700)
		}
		if !d.Type().IsRegular() {
			return nil
		}
		return copyFile(path, filepath.Join(dst, rel))
	})
}

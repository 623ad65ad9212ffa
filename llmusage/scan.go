package llmusage

// scanner reads one JSON document a byte at a time as it streams past,
// and keeps the few values a Meter asks for, by their path of object keys
// (["usage"], ["message", "usage"], ["model"]): each one's raw JSON, up to
// a bound. It never holds the document: its memory is its captures, the
// keys of the objects it is in, and one key.
type scanner struct {
	wants [][]string
	limit int

	// stack holds the containers the scanner is in; each frame's key is
	// the key it is the value of in the object around it.
	stack []frame
	// In the innermost object: wantKey until a key is read; key is the
	// key read, whose value comes next (hasKey).
	wantKey bool
	hasKey  bool
	key     []byte
	long    bool

	inString, escaped, stringIsKey bool
	inLiteral                      bool

	// capture is the index of the want being kept (-1: none), at depth
	// capDepth; over: it grew past limit and is dropped.
	capture  int
	capDepth int
	buf      []byte
	over     bool
	captured [][]byte
	// broken: what streamed is not JSON the scanner can follow.
	broken bool
}

type frame struct {
	object bool
	key    string
}

// maxDepth bounds the nesting the scanner follows: no API answer is
// deeper, and a document that is can only be made to cost memory.
const maxDepth = 64

func newScanner(wants [][]string, limit int) *scanner {
	return &scanner{wants: wants, limit: limit, capture: -1, captured: make([][]byte, len(wants))}
}

// value is the raw JSON kept for wants[i]; nil if none was.
func (s *scanner) value(i int) []byte { return s.captured[i] }

func (s *scanner) write(p []byte) {
	for _, c := range p {
		if s.broken {
			return
		}
		s.byte(c)
	}
}

func (s *scanner) keep(c byte) {
	if s.capture < 0 {
		return
	}
	if len(s.buf) >= s.limit {
		s.over = true
		return
	}
	s.buf = append(s.buf, c)
}

func (s *scanner) end() {
	if !s.over {
		s.captured[s.capture] = append([]byte(nil), s.buf...)
	}
	s.capture, s.buf, s.over = -1, s.buf[:0], false
}

func (s *scanner) byte(c byte) {
	if s.inString {
		s.keep(c)
		switch {
		case s.escaped:
			s.escaped = false
		case c == '\\':
			s.escaped = true
		case c == '"':
			s.inString = false
			if s.stringIsKey {
				s.hasKey, s.wantKey = !s.long, false
				return
			}
			if s.capture >= 0 && s.capDepth == len(s.stack) {
				s.end()
			}
			return
		}
		if s.stringIsKey && !s.escaped {
			if len(s.key) < 128 {
				s.key = append(s.key, c)
			} else {
				s.long = true
			}
		}
		return
	}
	if s.inLiteral {
		switch c {
		case ',', '}', ']', ' ', '\t', '\n', '\r':
			s.inLiteral = false
			if s.capture >= 0 && s.capDepth == len(s.stack) {
				s.end()
			}
		default:
			s.keep(c)
			return
		}
	}
	switch c {
	case ' ', '\t', '\n', '\r':
		s.keep(c)
	case ':':
		s.keep(c)
	case ',':
		s.keep(c)
		if s.inObject() {
			s.wantKey, s.hasKey = true, false
		}
	case '"':
		if s.inObject() && s.wantKey {
			s.keep(c)
			s.inString, s.stringIsKey, s.key, s.long = true, true, s.key[:0], false
			return
		}
		s.startValue(c)
		s.inString, s.stringIsKey = true, false
	case '{', '[':
		key := s.valueKey()
		s.startValue(c)
		if len(s.stack) == maxDepth {
			s.broken = true
			return
		}
		s.stack = append(s.stack, frame{object: c == '{', key: key})
		s.wantKey, s.hasKey = c == '{', false
	case '}', ']':
		s.keep(c)
		if len(s.stack) == 0 {
			s.broken = true
			return
		}
		s.stack = s.stack[:len(s.stack)-1]
		s.wantKey, s.hasKey = false, false
		if s.capture >= 0 && s.capDepth == len(s.stack) {
			s.end()
		}
	default:
		s.startValue(c)
		s.inLiteral = true
	}
}

func (s *scanner) inObject() bool { return len(s.stack) > 0 && s.stack[len(s.stack)-1].object }

// valueKey is the key of the value starting now: the key just read in an
// object, "" anywhere else.
func (s *scanner) valueKey() string {
	if s.inObject() && s.hasKey {
		return string(s.key)
	}
	return ""
}

// startValue begins a value whose first byte is c, keeping it if its
// path is wanted.
func (s *scanner) startValue(c byte) {
	if s.capture >= 0 {
		s.keep(c)
		return
	}
	if !s.inObject() || !s.hasKey {
		return
	}
	for i, w := range s.wants {
		if s.at(w) {
			s.capture, s.capDepth = i, len(s.stack)
			s.buf = append(s.buf[:0], c)
			return
		}
	}
}

// at reports whether the value starting now has the path w: the keys of
// the objects around it (below the document's own), then its key.
func (s *scanner) at(w []string) bool {
	if len(w) != len(s.stack) || w[len(w)-1] != string(s.key) {
		return false
	}
	for i := 1; i < len(s.stack); i++ {
		if !s.stack[i].object || s.stack[i].key != w[i-1] {
			return false
		}
	}
	return true
}

package bench

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"
	"time"
)

// clockTick is the unit of the CPU times in /proc (USER_HZ): 100 per
// second on Linux, fixed by the kernel's ABI whatever its internal HZ.
const clockTick = 10 * time.Millisecond

// cpuTime is the CPU time (user + system, every thread) process pid has
// used since it started, from /proc/PID/stat.
func cpuTime(pid int) (time.Duration, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0, fmt.Errorf("cpu time of process %d: %w", pid, err)
	}
	d, err := parseStat(b)
	if err != nil {
		return 0, fmt.Errorf("cpu time of process %d: %w", pid, err)
	}
	return d, nil
}

// parseStat reads utime and stime (fields 14 and 15) from a /proc/PID/stat
// line. The command name (field 2) is in parentheses and may itself hold
// spaces and parentheses, so the fields are counted from the last ')'.
func parseStat(b []byte) (time.Duration, error) {
	end := bytes.LastIndexByte(b, ')')
	if end < 0 {
		return 0, errors.New("stat line has no command name")
	}
	f := strings.Fields(string(b[end+1:]))
	// f[0] is field 3 (state), so field n is f[n-3].
	if len(f) < 13 {
		return 0, fmt.Errorf("stat line has %d fields after the command name, want at least 13", len(f))
	}
	var ticks int64
	for _, s := range f[11:13] {
		n, err := strconv.ParseInt(s, 10, 64)
		if err != nil || n < 0 {
			return 0, fmt.Errorf("stat field %q is not a tick count", s)
		}
		ticks += n
	}
	return time.Duration(ticks) * clockTick, nil
}

// machineCPU is the CPU time the whole machine has spent busy (every
// state but idle and iowait, summed over CPUs), from /proc/stat: with the
// processes under test subtracted, it shows what else ran meanwhile.
func machineCPU() (time.Duration, error) {
	b, err := os.ReadFile("/proc/stat")
	if err != nil {
		return 0, fmt.Errorf("machine cpu time: %w", err)
	}
	return parseMachineStat(b)
}

func parseMachineStat(b []byte) (time.Duration, error) {
	line, _, _ := bytes.Cut(b, []byte("\n"))
	f := strings.Fields(string(line))
	if len(f) < 5 || f[0] != "cpu" {
		return 0, errors.New("/proc/stat does not start with the cpu line")
	}
	var busy int64
	for i, s := range f[1:] {
		n, err := strconv.ParseInt(s, 10, 64)
		if err != nil {
			return 0, fmt.Errorf("/proc/stat cpu field %q: %w", s, err)
		}
		// user nice system idle iowait irq softirq steal guest guest_nice;
		// guest time is already counted in user.
		switch i {
		case 3, 4, 8, 9:
			continue
		}
		busy += n
	}
	return time.Duration(busy) * clockTick, nil
}

// loadAverage is the first field of /proc/loadavg, or "?" if unreadable.
func loadAverage() string {
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return "?"
	}
	f := strings.Fields(string(b))
	if len(f) < 3 {
		return "?"
	}
	return strings.Join(f[:3], " ")
}

package bench

import (
	"slices"
	"time"
)

// percentile of sorted values by the nearest-rank method; 0 for none.
func percentile(sorted []time.Duration, p float64) time.Duration {
	if len(sorted) == 0 {
		return 0
	}
	rank := int(p/100*float64(len(sorted))+0.5) - 1
	rank = max(0, min(rank, len(sorted)-1))
	return sorted[rank]
}

// spread is the median of repeated measurements with their extremes.
type spread struct {
	Median, Min, Max float64
	N                int
}

// spreadOf summarizes xs; the median of an even count is the mean of the
// middle two.
func spreadOf(xs []float64) spread {
	if len(xs) == 0 {
		return spread{}
	}
	s := slices.Clone(xs)
	slices.Sort(s)
	m := s[len(s)/2]
	if len(s)%2 == 0 {
		m = (s[len(s)/2-1] + s[len(s)/2]) / 2
	}
	return spread{Median: m, Min: s[0], Max: s[len(s)-1], N: len(s)}
}

func sortDurations(d []time.Duration) { slices.Sort(d) }

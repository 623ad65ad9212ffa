package filestore

import (
	"encoding/binary"
	"errors"
	"fmt"
	"hash/fnv"
	"io"
	"os"
)

// bbolt's on-disk meta page (format version 2, stable since boltdb): a
// 16-byte page header, then magic, version, page size, flags, root bucket
// (page id, sequence), freelist page id, high-water page id, txid and an
// FNV-64a checksum of the fields before it, in the machine's byte order.
const (
	boltMagic        = 0xED0CDAED
	boltVersion      = 2
	pageHeaderSize   = 16
	metaChecksummed  = 56 // bytes of meta covered by the checksum
	metaSize         = metaChecksummed + 8
	offMetaPageSize  = 8
	offMetaHighWater = 40
	offMetaTxid      = 48
)

// checkTruncated refuses a data file shorter than its own newest meta page
// says it is. bbolt maps the file and trusts that size: reading a page
// past the end faults (SIGBUS) inside bolt.Open, and the mapping then
// keeps the file locked until the process exits. A file with no valid
// meta at all is left to bbolt, which reports it as invalid.
func checkTruncated(path string) error {
	f, err := os.Open(path)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("filestore: reading data file %s: %w", path, err)
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return fmt.Errorf("filestore: reading data file %s: %w", path, err)
	}
	size := fi.Size()
	if size == 0 {
		return nil // bbolt initializes an empty file
	}

	meta0, ok0 := readMeta(f, 0)
	pageSizes := []int64{int64(os.Getpagesize()), 4096}
	if ok0 {
		pageSizes = []int64{int64(binary.NativeEndian.Uint32(meta0[offMetaPageSize:]))}
	}
	best, found := meta0, ok0
	for _, ps := range pageSizes {
		if meta1, ok := readMeta(f, ps); ok && (!found || txid(meta1) > txid(best)) {
			best, found = meta1, true
			break
		}
	}
	if !found {
		return nil
	}
	pageSize := int64(binary.NativeEndian.Uint32(best[offMetaPageSize:]))
	need := int64(binary.NativeEndian.Uint64(best[offMetaHighWater:])) * pageSize
	if pageSize <= 0 || size < need {
		return fmt.Errorf("filestore: data file %s is truncated: %d bytes, but its last commit spans %d; restore it from a backup", path, size, need)
	}
	return nil
}

func txid(meta []byte) uint64 { return binary.NativeEndian.Uint64(meta[offMetaTxid:]) }

// readMeta returns the meta of the page at off when it is a valid bbolt meta.
func readMeta(r io.ReaderAt, off int64) ([]byte, bool) {
	buf := make([]byte, metaSize)
	if _, err := r.ReadAt(buf, off+pageHeaderSize); err != nil {
		return nil, false
	}
	if binary.NativeEndian.Uint32(buf) != boltMagic || binary.NativeEndian.Uint32(buf[4:]) != boltVersion {
		return nil, false
	}
	h := fnv.New64a()
	h.Write(buf[:metaChecksummed])
	if h.Sum64() != binary.NativeEndian.Uint64(buf[metaChecksummed:]) {
		return nil, false
	}
	return buf, true
}

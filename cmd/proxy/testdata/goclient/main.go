// Command goclient is Go's net/http client, which never sends loopback
// destinations to a proxy: one POST, its status printed.
package main

import (
	"fmt"
	"net/http"
	"os"
	"strings"
	"time"
)

func main() {
	c := &http.Client{Timeout: 20 * time.Second}
	resp, err := c.Post(os.Args[1], "application/json", strings.NewReader("{}"))
	if err != nil {
		fmt.Println("go error", err)
		return
	}
	resp.Body.Close()
	fmt.Println("go", resp.StatusCode, resp.Header.Get("X-Stopgate-Refusal"))
}

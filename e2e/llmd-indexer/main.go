// Command llmd-indexer runs llm-d's KV-cache indexer (github.com/llm-d/llm-d-kv-cache: its ZMQ
// subscriber, event pool, in-memory block index and token processor, unchanged) against one KV
// event publisher, and answers prefix lookups for the tests.
//
// It connects to -endpoint as llm-d's pod discovery does (a SUB socket per engine, topic filter
// "kv@"). Each line on stdin is a lookup, {"tokens": [...], "model": "...", "pods": ["..."]};
// each answer, one line on stdout, gives the number of leading full blocks of those tokens the
// index places on each pod: {"keys": N, "prefix": {"pod": n}}.
package main

import (
	"bufio"
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"os"

	"github.com/go-logr/logr"
	"github.com/go-logr/logr/funcr"
	"k8s.io/apimachinery/pkg/util/sets"
	"sigs.k8s.io/controller-runtime/pkg/log"

	"github.com/llm-d/llm-d-kv-cache/pkg/kvcache/kvblock"
	"github.com/llm-d/llm-d-kv-cache/pkg/kvevents"
)

type lookup struct {
	Tokens []uint32 `json:"tokens"`
	Model  string   `json:"model"`
	Pods   []string `json:"pods"`
}

type answer struct {
	Keys   int            `json:"keys"`
	Prefix map[string]int `json:"prefix"`
	Error  string         `json:"error,omitempty"`
}

func main() {
	endpoint := flag.String("endpoint", "", "the engine's KV event PUB socket, tcp://HOST:PORT")
	blockSize := flag.Int("block-size", 16, "tokens per KV block (must equal the engine's)")
	verbosity := flag.Int("v", -1, "log llm-d's messages up to this verbosity on stderr (-1: none)")
	flag.Parse()
	if *endpoint == "" {
		fmt.Fprintln(os.Stderr, "llmd-indexer: -endpoint is required")
		os.Exit(2)
	}
	if *verbosity < 0 {
		log.SetLogger(logr.Discard())
	} else {
		log.SetLogger(funcr.New(func(prefix, args string) { fmt.Fprintln(os.Stderr, prefix, args) },
			funcr.Options{Verbosity: *verbosity}))
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()

	index, err := kvblock.NewInMemoryIndex(nil)
	if err != nil {
		fmt.Fprintln(os.Stderr, "llmd-indexer:", err)
		os.Exit(1)
	}
	tokens := kvblock.NewChunkedTokenDatabase(&kvblock.TokenProcessorConfig{BlockSize: *blockSize})
	cfg := kvevents.DefaultConfig()
	pool := kvevents.NewPool(cfg, index, tokens)
	pool.Start(ctx)
	subscribers := kvevents.NewSubscriberManager(pool)
	if err := subscribers.EnsureSubscriber(ctx, "engine", *endpoint, cfg.TopicFilter, true); err != nil {
		fmt.Fprintln(os.Stderr, "llmd-indexer:", err)
		os.Exit(1)
	}
	fmt.Println(`{"ready": true}`)

	in := bufio.NewScanner(os.Stdin)
	in.Buffer(make([]byte, 1<<20), 1<<24)
	out := json.NewEncoder(os.Stdout)
	for in.Scan() {
		var q lookup
		var a answer
		if err := json.Unmarshal(in.Bytes(), &q); err != nil {
			a.Error = err.Error()
			_ = out.Encode(a)
			continue
		}
		keys := tokens.TokensToKVBlockKeys(kvblock.EmptyBlockHash, q.Tokens, q.Model)
		a.Keys = len(keys)
		a.Prefix = map[string]int{}
		for _, pod := range q.Pods {
			a.Prefix[pod] = 0
		}
		if len(keys) > 0 {
			hits, err := index.Lookup(ctx, keys, sets.New(q.Pods...))
			if err != nil {
				a.Error = err.Error()
			}
			// The scorer's view: a pod counts the blocks it holds from the first one on.
			for _, pod := range q.Pods {
				for _, key := range keys {
					held := false
					for _, entry := range hits[key] {
						held = held || entry.PodIdentifier == pod
					}
					if !held {
						break
					}
					a.Prefix[pod]++
				}
			}
		}
		_ = out.Encode(a)
	}
	subscribers.Shutdown(ctx)
	pool.Shutdown(ctx)
}

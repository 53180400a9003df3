package main

// The connection to the router process: one Unix socket, frames of a 4-byte big-endian length
// followed by a JSON object. The front asks ("pick") and waits for the router's answer ("route"
// or "refuse") under the request's id; it tells ("resp", "chunk", "end") without waiting; the
// router pushes "ready" whenever it may have changed. The frame fields are the router's
// PickFrame and Answer (engine/router/front_socket.py); both sides must change together.

import (
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log"
	"net"
	"sync"
	"sync/atomic"
	"time"
)

// maxFrame bounds a frame from the router (an answer carries at most a rewritten request body).
const maxFrame = 1 << 30

type toRouter struct {
	T           string            `json:"t"`
	ID          uint64            `json:"id"`
	Headers     map[string]string `json:"headers,omitempty"`
	Body        []byte            `json:"body,omitempty"`
	Subset      json.RawMessage   `json:"subset,omitempty"`
	Mode        int32             `json:"mode,omitempty"`
	TooLarge    int               `json:"too_large,omitempty"`
	Problem     string            `json:"problem,omitempty"`
	Status      int               `json:"status,omitempty"`
	ContentType string            `json:"content_type,omitempty"`
	Served      string            `json:"served,omitempty"`
	EOS         bool              `json:"eos,omitempty"`
	Outcome     string            `json:"outcome,omitempty"`
}

type fromRouter struct {
	T       string      `json:"t"`
	ID      uint64      `json:"id"`
	Address string      `json:"address"`
	Body    []byte      `json:"body"`
	Changed bool        `json:"changed"`
	Status  int         `json:"status"`
	Headers [][2]string `json:"headers"`
	Details string      `json:"details"`
	Ready   bool        `json:"ready"`
}

var errRouterGone = errors.New("the router behind the picker is unreachable")

type routerConn struct {
	path    string
	onReady func(bool)
	nextID  atomic.Uint64

	mu      sync.Mutex
	conn    net.Conn
	pending map[uint64]chan *fromRouter
}

func newRouterConn(path string, onReady func(bool)) *routerConn {
	return &routerConn{path: path, onReady: onReady, pending: map[uint64]chan *fromRouter{}}
}

// run connects, reads until the connection breaks, and connects again, forever.
func (r *routerConn) run() {
	backoff := 20 * time.Millisecond
	for {
		conn, err := net.Dial("unix", r.path)
		if err != nil {
			time.Sleep(backoff)
			backoff = min(2*backoff, time.Second)
			continue
		}
		backoff = 20 * time.Millisecond
		r.mu.Lock()
		r.conn = conn
		r.mu.Unlock()
		err = r.readLoop(conn)
		log.Printf("connection to the router lost (%v); reconnecting", err)
		r.drop(conn)
	}
}

func (r *routerConn) readLoop(conn net.Conn) error {
	var head [4]byte
	for {
		if _, err := io.ReadFull(conn, head[:]); err != nil {
			return err
		}
		n := binary.BigEndian.Uint32(head[:])
		if n > maxFrame {
			return fmt.Errorf("frame of %d bytes from the router", n)
		}
		buf := make([]byte, n)
		if _, err := io.ReadFull(conn, buf); err != nil {
			return err
		}
		msg := &fromRouter{}
		if err := json.Unmarshal(buf, msg); err != nil {
			return fmt.Errorf("undecodable frame from the router: %w", err)
		}
		if msg.T == "ready" {
			r.onReady(msg.Ready)
			continue
		}
		r.mu.Lock()
		ch := r.pending[msg.ID]
		delete(r.pending, msg.ID)
		r.mu.Unlock()
		if ch != nil {
			ch <- msg
		}
	}
}

// drop fails every question still waiting on conn and marks the picker not ready.
func (r *routerConn) drop(conn net.Conn) {
	conn.Close()
	r.mu.Lock()
	if r.conn == conn {
		r.conn = nil
	}
	pending := r.pending
	r.pending = map[uint64]chan *fromRouter{}
	r.mu.Unlock()
	for _, ch := range pending {
		close(ch)
	}
	r.onReady(false)
}

func (r *routerConn) newID() uint64 { return r.nextID.Add(1) }

func (r *routerConn) send(msg *toRouter) error {
	payload, err := json.Marshal(msg)
	if err != nil {
		return err
	}
	frame := make([]byte, 4+len(payload))
	binary.BigEndian.PutUint32(frame, uint32(len(payload)))
	copy(frame[4:], payload)
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.conn == nil {
		return errRouterGone
	}
	if _, err := r.conn.Write(frame); err != nil {
		r.conn.Close() // the read loop sees it and reconnects
		return errRouterGone
	}
	return nil
}

// ask sends a pick and waits for its answer (or the stream's end, or the connection's).
func (r *routerConn) ask(done <-chan struct{}, msg *toRouter) (*fromRouter, error) {
	ch := make(chan *fromRouter, 1)
	r.mu.Lock()
	r.pending[msg.ID] = ch
	r.mu.Unlock()
	if err := r.send(msg); err != nil {
		r.forget(msg.ID)
		return nil, err
	}
	select {
	case rep, ok := <-ch:
		if !ok {
			return nil, errRouterGone
		}
		return rep, nil
	case <-done:
		r.forget(msg.ID)
		// The router may have routed it already: whatever it holds for the request goes.
		r.tell(&toRouter{T: "end", ID: msg.ID, Outcome: "aborted"})
		return nil, errors.New("the stream ended before the pick")
	}
}

func (r *routerConn) forget(id uint64) {
	r.mu.Lock()
	delete(r.pending, id)
	r.mu.Unlock()
}

// tell sends without waiting; a lost connection loses the message (the router releases the
// request's load when the connection drops).
func (r *routerConn) tell(msg *toRouter) { _ = r.send(msg) }

// Command kvmesh-extproc-front serves Envoy's ext_proc endpoint-picker protocol for a kvmesh
// router (`kvmesh router --ext-proc-port`, engine/router/front_proc.py starts it). It carries
// the gRPC streams and the protocol's state machine, off the router's Python event loop, and
// asks the router over a Unix socket for every decision: which engine, which error, and the load
// accounting stay the router's (one policy, one dispatcher).
//
// It prints "listening PORT" on stdout once it accepts connections, and exits when its parent
// (the router) is gone or on SIGTERM/SIGINT.
package main

import (
	"flag"
	"fmt"
	"io"
	"log"
	"net"
	"os"
	"os/signal"
	"syscall"
	"time"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
)

const service = "envoy.service.ext_proc.v3.ExternalProcessor"

type processor struct {
	extprocv3.UnimplementedExternalProcessorServer
	router  *routerConn
	picks   *pickRegistry
	maxBody int
}

func (p *processor) Process(stream extprocv3.ExternalProcessor_ProcessServer) error {
	first, err := stream.Recv()
	if err != nil {
		return nil
	}
	if first.GetObservabilityMode() {
		p.observe(first, stream)
		return nil
	}
	s := &pickStream{p: p, done: stream.Context().Done()}
	clean := false
	defer func() { s.close(clean) }()
	for req := first; ; {
		for _, a := range s.handle(req) {
			if err := stream.Send(a); err != nil {
				return nil
			}
		}
		req, err = stream.Recv()
		if err == io.EOF {
			clean = true
			return nil
		}
		if err != nil {
			return nil
		}
	}
}

// observe follows the response of a pick made on another stream (Envoy's observability mode:
// nothing is answered). The request headers carry the pick's id.
func (p *processor) observe(first *extprocv3.ProcessingRequest, stream extprocv3.ExternalProcessor_ProcessServer) {
	var target *pickStream
	for req := first; ; {
		switch r := req.GetRequest().(type) {
		case *extprocv3.ProcessingRequest_RequestHeaders:
			if target == nil {
				if id := headerMap(r.RequestHeaders)[pickIDHeader]; id != "" {
					target = p.picks.claim(id)
				}
			}
		case *extprocv3.ProcessingRequest_ResponseHeaders:
			if target != nil {
				target.responseHeaders(req)
			}
		case *extprocv3.ProcessingRequest_ResponseBody:
			if target != nil {
				target.responseBody(r.ResponseBody)
			}
		case *extprocv3.ProcessingRequest_ResponseTrailers:
			if target != nil {
				target.end("")
			}
		}
		var err error
		if req, err = stream.Recv(); err != nil {
			break
		}
	}
	if target != nil {
		target.end("aborted") // a no-op when the response was seen to its end
	}
}

func main() {
	listen := flag.String("listen", "127.0.0.1:0", "host:port to serve ext_proc and grpc.health.v1 on (port 0: any free one)")
	socket := flag.String("pick-socket", "", "the router's Unix socket to ask for picks")
	maxBody := flag.Int("max-request-bytes", 1<<22, "the router's --max-request-bytes: a longer body is refused (413) without being buffered")
	orphanTTL := flag.Duration("orphan-ttl", 5*time.Second, "how long a pick whose stream ended waits for an observer stream to claim it")
	parentPID := flag.Int("parent-pid", 0, "exit once this process (the router) is no longer the parent (0: the parent at start)")
	flag.Parse()
	log.SetPrefix("kvmesh-extproc-front: ")
	if *socket == "" {
		log.Fatal("--pick-socket is required")
	}
	lis, err := net.Listen("tcp", *listen)
	if err != nil {
		log.Fatalf("cannot listen on %s: %v", *listen, err)
	}
	hs := health.NewServer()
	setHealth := func(ok bool) {
		st := healthpb.HealthCheckResponse_NOT_SERVING
		if ok {
			st = healthpb.HealthCheckResponse_SERVING
		}
		hs.SetServingStatus("", st)
		hs.SetServingStatus(service, st)
	}
	setHealth(false)
	router := newRouterConn(*socket, setHealth)
	go router.run()
	srv := grpc.NewServer(grpc.MaxRecvMsgSize(*maxBody + 1<<20))
	extprocv3.RegisterExternalProcessorServer(srv, &processor{router: router, maxBody: *maxBody,
		picks: &pickRegistry{ttl: *orphanTTL, byID: map[string]*pickStream{}}})
	healthpb.RegisterHealthServer(srv, hs)
	go exitWithParent(srv, *parentPID)
	go func() {
		sig := make(chan os.Signal, 1)
		signal.Notify(sig, syscall.SIGTERM, syscall.SIGINT)
		<-sig
		stop(srv)
	}()
	fmt.Printf("listening %d\n", lis.Addr().(*net.TCPAddr).Port)
	if err := srv.Serve(lis); err != nil {
		log.Fatal(err)
	}
}

// stop drains streams for up to 5 s, then cuts what is left.
func stop(srv *grpc.Server) {
	done := make(chan struct{})
	go func() { srv.GracefulStop(); close(done) }()
	select {
	case <-done:
	case <-time.After(5 * time.Second):
		srv.Stop()
	}
	os.Exit(0)
}

// exitWithParent stops the front once its parent is gone (it was reparented). The router names
// itself with --parent-pid, so a router that died before this process got here is seen too.
func exitWithParent(srv *grpc.Server, parent int) {
	if parent == 0 {
		parent = os.Getppid()
	}
	for ; ; time.Sleep(500 * time.Millisecond) {
		if os.Getppid() != parent {
			log.Print("the router exited; stopping")
			stop(srv)
		}
	}
}

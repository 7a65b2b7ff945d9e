// One OS thread that runs every graph computation of an Engine, whichever thread asks.
//
// Why: the installed ggml's CPU backend runs a graph with OpenMP, and OpenMP keeps a team of
// worker threads per thread that starts a parallel region. An Engine evaluated from several
// Python threads (a server's slots, the step batcher whose leading thread changes from batch to
// batch) would wake a second team while the last caller's team still spins, and on a machine with
// few cores the two teams fight for them: a batch of four decode steps of Qwen2.5-Coder-0.5B took
// 138 ms called from four threads in turn and 89 ms called from one. Here every computation
// starts from this thread, so one team serves the Engine for its lifetime, as one thread decodes
// in llama.cpp's server.
#pragma once

#include <condition_variable>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>

namespace river {

class ComputeThread {
public:
    ComputeThread() : thread_([this] { serve(); }) {}
    ~ComputeThread() {
        {
            std::lock_guard<std::mutex> lock(mu_);
            stop_ = true;
        }
        wake_.notify_all();
        thread_.join();
    }
    ComputeThread(const ComputeThread&) = delete;
    ComputeThread& operator=(const ComputeThread&) = delete;

    // Run `job` on this thread and wait for it; its exception is rethrown here. One job at a
    // time: callers on other threads wait their turn. A job that itself calls run() runs inline.
    void run(const std::function<void()>& job) {
        if (std::this_thread::get_id() == thread_.get_id()) {
            job();
            return;
        }
        std::lock_guard<std::mutex> turn(turn_);
        std::exception_ptr error;
        {
            std::unique_lock<std::mutex> lock(mu_);
            job_ = &job;
            done_ = false;
            wake_.notify_all();
            finished_.wait(lock, [this] { return done_; });
            error = error_;
            error_ = nullptr;
        }
        if (error) std::rethrow_exception(error);
    }

private:
    void serve() {
        std::unique_lock<std::mutex> lock(mu_);
        for (;;) {
            wake_.wait(lock, [this] { return job_ != nullptr || stop_; });
            if (!job_) return;  // stopping, nothing asked
            const std::function<void()>* job = job_;
            lock.unlock();
            std::exception_ptr error;
            try {
                (*job)();
            } catch (...) {
                error = std::current_exception();
            }
            lock.lock();
            job_ = nullptr;
            error_ = error;
            done_ = true;
            finished_.notify_all();
        }
    }

    std::mutex turn_;  // one caller at a time
    std::mutex mu_;
    std::condition_variable wake_, finished_;
    const std::function<void()>* job_ = nullptr;
    std::exception_ptr error_;
    bool done_ = false;
    bool stop_ = false;
    std::thread thread_;  // last: it starts once the members it reads exist
};

}  // namespace river

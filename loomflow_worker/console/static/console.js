// Live events of a run, from the console's server-sent events.
for (const box of document.querySelectorAll("[data-events]")) {
  const list = box.querySelector("ol");
  const source = new EventSource(box.dataset.events);
  const add = (message, end) => {
    const e = JSON.parse(message.data);
    const item = document.createElement("li");
    item.className = (e.replayed ? "replayed" : "") + (end ? " end" : "");
    item.textContent = `${e.at} a${e.attempt} ${e.replayed ? "replay" : "      "} ${e.kind.padEnd(12)} ${e.summary}`;
    list.appendChild(item);
    list.scrollTop = list.scrollHeight;
    box.dataset.count = list.children.length;
  };
  source.onopen = () => { box.dataset.state = "following"; };
  source.onmessage = (message) => add(message, false);
  source.addEventListener("end", (message) => {
    add(message, true);
    source.close();
    box.dataset.state = "ended";
    // The run ended while this page watched: show its result and final timeline.
    if (box.dataset.live === "1") setTimeout(() => location.reload(), 800);
  });
  source.onerror = () => { source.close(); if (box.dataset.state !== "ended") box.dataset.state = "closed"; };
}
